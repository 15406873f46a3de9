"""Sandbox throughput: hello-world latency and requests/s, fork server vs. a fresh interpreter.

Starts ``turnrl-sandbox serve`` twice on loopback — ``--python-mode fork`` (the warm fork
server with numpy/sympy preloaded) and ``--python-mode exec`` (the baseline: the same
containment, but a fresh ``python main.py`` per request, as a plain per-request subprocess
server does) — and for each measures:

* latency of sequential requests (p50/p99), and
* requests/s and latency with ``--concurrency`` clients (threads with their own sessions),

for ``print('hello')`` and for a ReTool-like snippet that imports sympy. Prints JSON.

    uv run --package turnrl-tool-envs --group test python benchmarks/sandbox_throughput.py
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from turnrl.tool_envs.sandbox.embedded import EmbeddedSandbox

SNIPPETS = {
    "hello": ("print('hello')", "hello\n"),
    "sympy": (
        "import sympy\nprint(sympy.factorint(2**20 - 1))",
        "{3: 1, 5: 2, 11: 1, 31: 1, 41: 1}\n",
    ),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    url: str, code: str, expected: str, requests_n: int, concurrency: int
) -> dict[str, float]:
    local = threading.local()
    body = {"code": code, "language": "python", "run_timeout": 60}
    errors: list[str] = []

    def one(_: int) -> float:
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        start = time.perf_counter()
        answer = session.post(f"{url}/run_code", json=body, timeout=60).json()
        elapsed = time.perf_counter() - start
        if (answer.get("run_result") or {}).get("stdout") != expected:
            errors.append(json.dumps(answer)[:300])
        return elapsed

    for i in range(5):  # warm up connections and caches
        one(i)
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        latencies = list(pool.map(one, range(requests_n)))
        wall = time.perf_counter() - start
    return {
        "p50_ms": round(percentile(latencies, 0.5) * 1e3, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1e3, 2),
        "requests_per_s": round(requests_n / wall, 1),
        "requests": requests_n,
        "wrong_results": len(errors),
        **({"first_error": errors[0]} if errors else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    report: dict[str, object] = {
        "cpus": os.cpu_count(),
        "load_avg_before": os.getloadavg()[0],
        "requests": args.requests,
        "concurrency": args.concurrency,
    }
    # Both servers run at once and each snippet is measured on both back to back, so the
    # pair sees the same machine load.
    with (
        EmbeddedSandbox("--python-mode", "fork") as fork,
        EmbeddedSandbox("--python-mode", "exec") as exec_,
    ):
        report["isolation"] = fork.ping()["isolation"]
        for name, (code, expected) in SNIPPETS.items():
            for mode, server in (("fork", fork), ("exec", exec_)):
                n = args.requests if mode == "fork" else max(args.requests // 10, 32)
                n = n if (mode, name) != ("exec", "sympy") else 16  # a fresh `import sympy` is slow
                report[f"{mode}/{name}/sequential"] = measure(server.url, code, expected, n, 1)
                report[f"{mode}/{name}/concurrent"] = measure(
                    server.url, code, expected, n, args.concurrency
                )
    for name in SNIPPETS:
        fork, base = report[f"fork/{name}/concurrent"], report[f"exec/{name}/concurrent"]
        fork_seq, base_seq = report[f"fork/{name}/sequential"], report[f"exec/{name}/sequential"]
        report[f"speedup/{name}"] = {
            "requests_per_s": round(fork["requests_per_s"] / base["requests_per_s"], 2),  # type: ignore[index]
            "sequential_p50": round(base_seq["p50_ms"] / fork_seq["p50_ms"], 2),  # type: ignore[index]
        }
    report["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
