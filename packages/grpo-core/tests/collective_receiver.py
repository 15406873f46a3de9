"""A stand-in for a vLLM engine's weight-transfer side, for CPU tests (no GPU here).

vLLM's NCCL weight-transfer engine cannot run without a GPU, so this process serves the
same HTTP routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/update_weight_version``,
``/weight_info``, ``/pause``, ``/resume``, ``/reset_prefix_cache``,
``/shutdown_weight_transfer_engine``) with the same JSON bodies, plus ``GET /get_world_size``,
joins the trainer's group as rank ``rank_offset`` with gloo over the trainer's TCPStore, and
receives each bucket as one packed uint8 broadcast, cut by the names / dtypes / shapes of the
``/update_weights`` call.

It keeps a prefix cache as vLLM does: an entry, once computed, is reused by every later
prompt with that prefix whatever weights were loaded since, until ``/reset_prefix_cache``
or a ``/pause`` that clears it (``abort`` / ``wait``: vLLM ignores ``clear_cache`` for
``keep``). Each entry records the weights it was computed with (:attr:`Receiver.weights_round`,
bumped by every received bucket). Running requests pin their blocks: the reset then answers
``{"success": false}`` unless ``reset_running_requests=true`` preempts them first.

Test-only routes: ``GET /received`` (calls counted and in order, the init and update bodies,
the prefix cache), ``POST /prefill`` (serve a prompt with the given ``prefix``: a cache hit
or a new entry), ``POST /dump`` (save the received tensors) and ``POST /mode`` (reset, and set
the :class:`Receiver` flags to simulate failures or other engines).

Usage: ``python collective_receiver.py PORT``; prints ``ready <port>`` once listening
(PORT 0 picks one).
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file


class Receiver:
    """The engine-side state: group, received weights, version, call counts."""

    def __init__(
        self,
        reject_init: bool = False,
        stale_version: bool = False,
        reject_update: bool = False,
        world_size: int = 1,
        no_transfer_api: bool = False,
        record_only: bool = False,
        running_requests: int = 0,
        reset_declines: bool = False,
    ) -> None:
        self.reject_init = reject_init
        """Answer 400 to ``/init_weight_transfer_engine``."""
        self.stale_version = stale_version
        """Never record a new weight version."""
        self.reject_update = reject_update
        """Answer 400 to ``/update_weights`` without joining the broadcast."""
        self.world_size = world_size
        """What ``GET /get_world_size`` reports (this stand-in always joins as one rank)."""
        self.no_transfer_api = no_transfer_api
        """Answer 404 to the weight-transfer routes, as a vLLM without the RL API does."""
        self.record_only = record_only
        """Record init / update bodies without joining any collective (another backend's
        transport is faked in the trainer process)."""
        self.running_requests = running_requests
        """Requests generating on this engine (they pin their prefix-cache blocks)."""
        self.reset_declines = reset_declines
        """Answer ``{"success": false}`` to every ``/reset_prefix_cache``, as a vLLM whose
        blocks are held by KV transfers in flight."""
        self.weights_round = 0
        """Buckets received so far: the weights a cache entry was computed with."""
        self.cache: dict[str, int] = {}
        """The prefix cache: prefix -> ``weights_round`` it was computed with."""
        self.log: list[str] = []
        """POST routes in the order they came (with their query)."""
        self.inits: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []
        self.group: Any = None
        self.weights: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def init(self, info: dict[str, Any]) -> None:
        if self.reject_init:
            raise ValueError("this engine rejects weight-transfer init (test)")
        self.inits.append(info)
        if self.record_only:
            return
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore(
            info["master_address"],
            info["master_port"],
            info["world_size"],
            is_master=False,
            timeout=timeout,
        )
        prefixed = dist.PrefixStore("turnrl_weight_transfer", store)
        self.group = dist.ProcessGroupGloo(
            prefixed, info["rank_offset"], info["world_size"], timeout
        )
        self.packed_buffer_size_bytes = info["packed_buffer_size_bytes"]

    def update(self, info: dict[str, Any]) -> None:
        if self.reject_update:
            raise ValueError("this engine rejects update_weights (test)")
        self.updates.append(info)
        self.weights_round += 1  # from here on the engine computes with other weights
        if self.record_only:
            return
        dtypes = [getattr(torch, d) for d in info["dtype_names"]]
        sizes = [math.prod(s) * d.itemsize for s, d in zip(info["shapes"], dtypes, strict=True)]
        packed = torch.empty(sum(sizes), dtype=torch.uint8)
        self.group.broadcast([packed], dist.BroadcastOptions()).wait()
        for name, shape, dtype, part in zip(
            info["names"], info["shapes"], dtypes, packed.split(sizes), strict=True
        ):
            self.weights[name] = part.clone().view(dtype).view(shape)

    def prefill(self, prefix: str) -> bool:
        """Serve a prompt starting with ``prefix``: reuse its cached entry (True, a hit) or
        compute one with the weights now loaded."""
        if prefix in self.cache:
            return True
        self.cache[prefix] = self.weights_round
        return False

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        """vLLM's rule: running requests' blocks cannot be freed, so the reset declines
        unless they are preempted first (they then recompute their KV cache)."""
        if self.reset_declines or (self.running_requests and not reset_running_requests):
            return False
        self.cache.clear()
        return True

    def pause(self, mode: str) -> None:
        """``abort`` / ``wait`` end the running requests and clear the cache; ``keep``
        freezes them and keeps it."""
        if mode in ("abort", "wait"):
            self.running_requests = 0
            self.cache.clear()


TRANSFER_ROUTES = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
)


class Handler(BaseHTTPRequestHandler):
    receiver: Receiver

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        r = self.receiver
        route = self.path.split("?")[0]
        with r.lock:
            r.calls[route] = r.calls.get(route, 0) + 1
        if route == "/get_world_size" and not r.no_transfer_api:
            self._reply(200, {"world_size": r.world_size})
        elif self.path == "/weight_info":
            self._reply(200, {"weight_version": r.version})
        elif self.path == "/received":
            self._reply(
                200,
                {
                    "calls": r.calls,
                    "log": r.log,
                    "names": sorted(r.weights),
                    "inits": r.inits,
                    "updates": r.updates,
                    "weights_round": r.weights_round,
                    "cache": r.cache,
                },
            )
        elif self.path == "/health":
            self._reply(200, {})
        else:
            self._reply(404, {"error": self.path})

    def do_POST(self) -> None:
        r = self.receiver
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        route, _, query = self.path.partition("?")
        params = dict(urllib.parse.parse_qsl(query))
        with r.lock:
            r.calls[route] = r.calls.get(route, 0) + 1
            r.log.append(self.path)
        if r.no_transfer_api and route in TRANSFER_ROUTES:
            self._reply(404, {"detail": "Not Found"})
            return
        try:
            if route == "/init_weight_transfer_engine":
                r.init(body["init_info"])
            elif route == "/update_weights":
                r.update(body["update_info"])
            elif route == "/finish_weight_update":
                if not r.stale_version and body.get("weight_version") is not None:
                    r.version = body["weight_version"]
            elif route == "/update_weight_version":
                if not r.stale_version:
                    r.version = body["new_version"]
            elif route == "/reset_prefix_cache":
                running = params.get("reset_running_requests") == "true"
                self._reply(200, {"success": r.reset_prefix_cache(running)})
                return
            elif route == "/pause":
                r.pause(params.get("mode", "abort"))
            elif route == "/prefill":
                self._reply(200, {"hit": r.prefill(body["prefix"])})
                return
            elif route == "/mode":
                Handler.receiver = Receiver(**body)
            elif route == "/dump":
                save_file(r.weights, body["path"])
            elif route not in (
                "/start_weight_update",
                "/resume",
                "/shutdown_weight_transfer_engine",
            ):
                self._reply(404, {"error": route})
                return
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": str(exc)})
            return
        self._reply(200, {"message": "ok"})


def main() -> None:
    port = int(sys.argv[1])
    Handler.receiver = Receiver()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"ready {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
