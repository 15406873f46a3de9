"""Shutdown time of supervised children: `stop_all` against stopping them one by one; prints JSON.

Each child is a Python process that, like an inference engine draining requests, takes
`drain_s` seconds to exit after SIGTERM. The baseline, measured in the same run, stops the
children one after the other with `ManagedProcess.stop` (what a loop over engines does);
`stop_all` sends SIGTERM to every process group first, so the drains overlap. Also reports
how long `wait_healthy` takes to notice a real HTTP server once it is listening.

    uv run --only-group dev nox -s "tests-3.11(package='npu-runtime')" -R -- --co -q  # env
    .nox/tests-3-11-package-npu-runtime/bin/python benchmarks/npu_runtime_supervise.py
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import time
from pathlib import Path

from turnrl.npu_runtime.supervise import ManagedProcess, start_process, stop_all

DRAINING_CHILD = """
import signal, sys, time
def drain(sig, frame):
    time.sleep(float(sys.argv[1]))
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
print("ready", flush=True)
while True:
    time.sleep(1)
"""

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
open(sys.argv[2], "w").write(repr(__import__("time").time()))
server.serve_forever()
"""


def start_children(folder: Path, n: int, drain_s: float) -> list[ManagedProcess]:
    script = folder / "child.py"
    script.write_text(DRAINING_CHILD)
    procs = [
        start_process(
            [sys.executable, str(script), str(drain_s)], name=f"c{i}", log_path=folder / f"c{i}.log"
        )
        for i in range(n)
    ]
    for proc in procs:  # wait until each installed its handler
        while "ready" not in proc.tail(1):
            time.sleep(0.01)
    return procs


def shutdown_seconds(folder: Path, n: int, drain_s: float, parallel: bool) -> float:
    procs = start_children(folder, n, drain_s)
    start = time.perf_counter()
    if parallel:
        stop_all(grace=10)
    else:
        for proc in procs:
            proc.stop(grace=10)
    elapsed = time.perf_counter() - start
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
    return elapsed


def health_notice_seconds(folder: Path, interval: float, repeats: int) -> list[float]:
    """Delay between a server starting to listen and wait_healthy returning."""
    script = folder / "server.py"
    script.write_text(SERVER)
    delays = []
    for i in range(repeats):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        stamp = folder / f"listening{i}"
        with start_process(
            [sys.executable, str(script), str(port), str(stamp)],
            name="srv",
            log_path=folder / "srv.log",
        ) as proc:
            proc.wait_healthy(f"http://127.0.0.1:{port}/", timeout=30, interval=interval)
            delays.append(time.time() - float(stamp.read_text()))
    return delays


def main() -> None:
    n, drain_s = 4, 1.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sequential = shutdown_seconds(folder, n, drain_s, parallel=False)
        parallel = shutdown_seconds(folder, n, drain_s, parallel=True)
        delays = {iv: health_notice_seconds(folder, iv, 5) for iv in (0.5, 0.1)}
    print(
        json.dumps(
            {
                "children": n,
                "drain_s": drain_s,
                "sequential_stop_s": round(sequential, 3),
                "stop_all_s": round(parallel, 3),
                "speedup": round(sequential / parallel, 2),
                "health_notice_mean_s": {
                    str(k): round(sum(v) / len(v), 3) for k, v in delays.items()
                },
                "health_notice_max_s": {str(k): round(max(v), 3) for k, v in delays.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
