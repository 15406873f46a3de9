"""``turnrl-tau``: replay tau-bench tasks' gold actions, or write a synthetic mini-retail domain.

    turnrl-tau replay --domain retail --data-dir DIR --tasks DIR/tasks_train.jsonl \\
        [--limit N] [--gt-hashes DIR/gt_data_hashes_train.json]
    turnrl-tau synth --seed 0 --out DIR [--users 12] [--tasks 20]

``replay`` prints one JSON line per task: ``index``, ``data_hash`` (after replaying the
gold actions on a fresh database), ``gt_data_hash`` (the ground truth computed the same
way, cached), ``reward`` (tau-bench's rule with the gold replay as the agent, whose
messages are the task's outputs), ``replay_errors`` and, with ``--gt-hashes``,
``gt_match`` against the recorded hashes. The exit status is 1 when any ``gt_match`` is
false.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turnrl.rewards.tau import TauRewardInput, tau_reward
from turnrl.tool_envs.tau.db import DataError
from turnrl.tool_envs.tau.domain import TauDomain
from turnrl.tool_envs.tau.synth import generate, write
from turnrl.tool_envs.tau.tasks import TaskFormatError, load_tasks


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl-tau", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    replay = sub.add_parser("replay", help="replay gold actions and print hashes and rewards")
    replay.add_argument("--domain", required=True, choices=["retail", "airline"])
    replay.add_argument("--data-dir", required=True, type=Path, help="folder in tau-bench's layout")
    replay.add_argument("--tasks", required=True, type=Path, help="tasks .jsonl or tasks_*.py")
    replay.add_argument("--limit", type=int, default=None, help="replay only the first N tasks")
    replay.add_argument(
        "--gt-hashes", type=Path, default=None, help="gt_data_hashes_*.json to compare"
    )
    synth = sub.add_parser("synth", help="write a synthetic mini-retail domain")
    synth.add_argument("--seed", type=int, required=True)
    synth.add_argument("--out", type=Path, required=True)
    synth.add_argument("--users", type=int, default=12)
    synth.add_argument("--tasks", type=int, default=20)
    return parser


def _recorded_hashes(path: Path) -> dict[int, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {int(t["task_index"]): str(t["gt_data_hash"]) for t in data["tasks"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a gt_data_hashes file ({type(exc).__name__}: {exc})") from exc


def replay_lines(
    domain: TauDomain, tasks: Sequence[Any], recorded: dict[int, str] | None
) -> list[dict]:
    """One result record per task (what ``replay`` prints)."""
    lines = []
    for index, task in enumerate(tasks):
        replay = domain.replay(task.actions)
        gt = domain.gt_hash(task)
        outputs = tuple(task.outputs)  # the gold replay says each required output
        reward = tau_reward(TauRewardInput(replay.data_hash, gt, outputs, outputs))
        line: dict[str, Any] = {
            "index": index,
            "data_hash": replay.data_hash,
            "gt_data_hash": gt,
            "reward": reward.reward,
            "replay_errors": replay.errors,
        }
        if replay.unknown_actions:
            line["unknown_actions"] = replay.unknown_actions
        if recorded is not None:
            line["gt_match"] = recorded.get(index) == replay.data_hash
        lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``turnrl-tau``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "synth":
            out = write(generate(args.seed, num_users=args.users, num_tasks=args.tasks), args.out)
            print(json.dumps({"out": str(out), "seed": args.seed}))
            return 0
        if args.limit is not None and args.limit < 0:
            raise ValueError("--limit must be >= 0")
        domain = TauDomain.from_dir(args.domain, args.data_dir)
        tasks = load_tasks(args.tasks)[: args.limit]
        recorded = _recorded_hashes(args.gt_hashes) if args.gt_hashes else None
    except (DataError, TaskFormatError, ValueError, OSError) as exc:
        print(f"turnrl-tau: error: {exc}", file=sys.stderr)
        return 2
    status = 0
    for line in replay_lines(domain, tasks, recorded):
        print(json.dumps(line), flush=True)
        if line.get("gt_match") is False:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
