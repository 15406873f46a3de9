"""``turnrl-sandbox``: the code sandbox's command line.

turnrl-sandbox serve --host 127.0.0.1 --port 8080 [--token T] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import sys

from turnrl.tool_envs.sandbox.limits import SandboxLimits

_UID_BASE, _UIDS_PER_PORT = 2_000_000, 1024


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl-sandbox", description="turnrl's code sandbox.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve SandboxFusion's /run_code API over HTTP")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument(
        "--token",
        default=os.environ.get("TURNRL_SANDBOX_TOKEN"),
        help="bearer token required on /run_code (default: $TURNRL_SANDBOX_TOKEN; prefer the "
        "variable, a command line is visible to every process)",
    )
    serve.add_argument("--workers", type=int, default=1, help="fork-server processes")
    serve.add_argument("--slots", type=int, default=64, help="concurrent runs per fork server")
    serve.add_argument(
        "--python-mode",
        choices=["fork", "exec"],
        default="fork",
        help="fork: run in a warm interpreter (fast); exec: fresh interpreter per run",
    )
    serve.add_argument("--max-processes", type=int, default=SandboxLimits.max_processes)
    serve.add_argument("--max-output-bytes", type=int, default=SandboxLimits.max_output_bytes)
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="serve even where runs cannot be contained (not root, no namespaces, unreadable "
        "interpreter); prints a warning, /v1/ping names the gaps. Only for code you trust",
    )
    serve.add_argument(
        "--base-uid",
        type=int,
        default=None,
        help="first run uid (default 2,000,000 + port x 1024, so servers on other ports never "
        "share uids)",
    )
    serve.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop when this process ends (the embedded sandbox passes its own)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run it."""
    args = _parser().parse_args(argv)
    from turnrl.tool_envs.sandbox.server import ContainmentError, serve  # aiohttp when serving

    base_uid = args.base_uid
    if base_uid is None:
        base_uid = _UID_BASE + args.port * _UIDS_PER_PORT
        if args.workers * args.slots > _UIDS_PER_PORT:
            sys.exit(f"turnrl-sandbox: workers x slots > {_UIDS_PER_PORT}: pass --base-uid")
    config = SandboxLimits(
        max_processes=args.max_processes, max_output_bytes=args.max_output_bytes, base_uid=base_uid
    )
    try:
        serve(
            args.host,
            args.port,
            token=args.token,
            workers=args.workers,
            slots=args.slots,
            python_mode=args.python_mode,
            config=config,
            insecure=args.insecure,
            parent_pid=args.parent_pid,
        )
    except (ValueError, ContainmentError) as exc:
        sys.exit(f"turnrl-sandbox: {exc}")


if __name__ == "__main__":
    main()
