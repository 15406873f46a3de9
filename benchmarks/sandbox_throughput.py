"""Sandbox throughput: hello-world latency and requests/s, fork server vs. a fresh interpreter.

Starts ``turnrl-sandbox serve`` twice on loopback — ``--python-mode fork`` (the warm fork
server with numpy/sympy preloaded) and ``--python-mode exec`` (the baseline: the same
containment, but a fresh ``python main.py`` per request, as a plain per-request subprocess
server does) — and for each measures:

* latency of sequential requests (p50/p99), and
* requests/s and latency with ``--concurrency`` clients (threads with their own sessions),

for ``print('hello')`` and for a ReTool-like snippet that imports sympy. Prints JSON.

An honest baseline imports from bytecode: an environment made by ``uv sync`` (without
``--compile-bytecode``) has no ``.pyc`` files, and where ``PYTHONDONTWRITEBYTECODE`` is set
or the run cannot write (a sandbox run never can) every fresh interpreter would compile
sympy from source again. So before measuring, the script finds every module a fresh
interpreter loads for the snippets, compiles the packages among them that lack current
bytecode (``compileall``, into their ``__pycache__``), checks again and records the result
under ``"bytecode"``. ``--no-compile-bytecode`` only checks (and measures whatever is there).

    uv run --package turnrl-tool-envs --group test python benchmarks/sandbox_throughput.py
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import subprocess
import sys
import sysconfig
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


# Runs the snippets in a fresh interpreter (as the exec baseline does, without writing
# bytecode) and prints the source files of the modules it loaded whose cached bytecode is
# missing or out of date.
_STALE_BYTECODE_PROBE = r"""
import contextlib, importlib.util, io, json, os, sys
with contextlib.redirect_stdout(io.StringIO()):
    for code in json.loads(sys.argv[1]):
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
stale = []
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None) or ""
    if not path.endswith(".py") or not os.path.isfile(path):
        continue
    try:
        with open(importlib.util.cache_from_source(path), "rb") as f:
            header = f.read(16)
    except OSError:
        stale.append(path)
        continue
    st = os.stat(path)
    by_hash = int.from_bytes(header[4:8], "little") != 0
    fresh = header[:4] == importlib.util.MAGIC_NUMBER and (
        by_hash
        or (
            int.from_bytes(header[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(header[12:16], "little") == st.st_size & 0xFFFFFFFF
        )
    )
    if not fresh:
        stale.append(path)
print(json.dumps(stale))
"""


def stale_bytecode() -> list[str]:
    """Source files a fresh interpreter loads for the snippets without current bytecode."""
    codes = json.dumps([code for code, _ in SNIPPETS.values()])
    out = subprocess.run(
        [sys.executable, "-I", "-B", "-c", _STALE_BYTECODE_PROBE, codes],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    stale: list[str] = json.loads(out)
    return stale


def compile_bytecode(stale: list[str]) -> list[str]:
    """Compile each site-packages entry (whole package) and other file that ``stale`` names.

    Returns the names compiled (package or file names, no paths).
    """
    paths = sysconfig.get_paths()
    site = {os.path.realpath(paths[key]) for key in ("purelib", "platlib")}
    targets: set[str] = set()
    for path in map(os.path.realpath, stale):
        root = next((r for r in site if path.startswith(r + os.sep)), None)
        top = os.path.relpath(path, root).split(os.sep)[0] if root else ""
        targets.add(os.path.join(root, top) if root else path)
    for target in sorted(targets):
        if os.path.isdir(target):
            compileall.compile_dir(target, quiet=2, workers=0)
        else:
            compileall.compile_file(target, quiet=2)
    return sorted(os.path.basename(t) for t in targets)


def bytecode_report(compile_it: bool) -> dict[str, object]:
    """Check (and with ``compile_it`` first complete) the bytecode the baseline imports."""
    stale = stale_bytecode()
    report: dict[str, object] = {"stale_before": len(stale)}
    if compile_it and stale:
        report["compiled"] = compile_bytecode(stale)
        stale = stale_bytecode()
    report["stale_after"] = len(stale)
    report["complete"] = not stale
    return report


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
    parser.add_argument(
        "--no-compile-bytecode",
        dest="compile_bytecode",
        action="store_false",
        help="do not compile missing bytecode first (only check and report it)",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="extra `turnrl-sandbox serve` options for both servers, e.g. '--workers 1'",
    )
    args = parser.parse_args()
    report: dict[str, object] = {
        "cpus": os.cpu_count(),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "bytecode": bytecode_report(args.compile_bytecode),
        "server_args": args.server_args,
        "load_avg_before": os.getloadavg(),
    }
    extra = args.server_args.split()
    # Both servers run at once and each snippet is measured on both back to back, so the
    # pair sees the same machine load.
    with (
        EmbeddedSandbox("--python-mode", "fork", *extra) as fork,
        EmbeddedSandbox("--python-mode", "exec", *extra) as exec_,
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
    report["load_avg_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
