"""``uv run apps/agent audit --run-dir DIR [--step N]``: replay a run's exported trajectories
through the trainer at the weights that sampled them.

A training run (``--save-trajectories``, on by default) appends every rollout episode's
gateway export to ``DIR/trajectories/step-<N>.jsonl`` (:func:`save_rollout`): one line per
episode with ``version`` (the weight version the engines served when the rollout started:
``N - 1`` in the synchronous loop), ``sampling`` (the gateway's temperature / top-p /
top-k), the episode's status, reward, error, and its ``rows`` (``ledger.rows()``: per chain
``ids``, ``loss_mask``, behaviour ``logprobs``, ``versions``, ``fork_reason``). The gateway
records no per-token version yet (``versions`` are None), so the line's ``version`` is used.

The audit loads each version's weights (``recipe.audit.trainer_at_version``), scores every
chain of every episode (a failed one's too) with ``training.audit.audit`` under the recorded
sampling and reports, per version and in all: tokens compared, the |trainer - behaviour|
log-prob gap p50/p90/p99/max, turn boundaries (where the loss mask changes) and the gap of
the sampled tokens next to them, and **boundary mismatches**: boundaries where the exported
ids differ, within 2 tokens, from a fresh tokenisation of the conversation's text (the
policy's tokenizer: decode, then encode) — the ids a pipeline that re-renders the history
would have trained on. The export keeps no messages, so the fresh render is of the text.
Writes ``DIR/audit.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.audit import start_policy, trainer_at_version
from turnrl.grpo_core.recipe.run_folder import read_run_config
from turnrl.grpo_core.training.audit import AuditReport, AuditSequence, audit
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams
from turnrl.tool_envs.trajectory import Trajectory
from turnrl_app_agent.config import from_dict

TRAJECTORY_DIR = "trajectories"
WINDOW = 2
"""Tokens either side of a boundary compared with the fresh tokenisation."""


def save_rollout(
    folder: Path, version: int, sampling: SamplingParams, samples: Sequence[Trajectory]
) -> Path:
    """Append the samples' exports (``metadata["rows"]``, taken out) to the rollout's file."""
    path = folder / TRAJECTORY_DIR / f"step-{version + 1}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    with path.open("a") as out:
        for s in samples:
            line = {
                "version": version,
                "sampling": record,
                "group_id": s.group_id,
                "sample_index": s.sample_index,
                "session": s.metadata.get("session"),
                "status": s.status,
                "reward": s.reward,
                "error": s.metadata.get("error"),
                "rows": s.metadata.pop("rows", []),
            }
            out.write(json.dumps(line) + "\n")
    return path


def read_rollouts(folder: Path, step: int | None) -> list[dict[str, Any]]:
    """Every saved episode of the run (of ``step`` only when given)."""
    root = folder / TRAJECTORY_DIR
    files = sorted(root.glob("step-*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem)))
    if step is not None:
        files = [p for p in files if p.name == f"step-{step}.jsonl"]
    if not files:
        which = f"step {step}'s" if step is not None else "any"
        raise FileNotFoundError(
            f"{root} holds no {which} trajectories (train with --save-trajectories)"
        )
    return [json.loads(line) for p in files for line in p.read_text().splitlines() if line]


def run_audit(folder: Path, step: int | None = None, console: Any = None) -> dict[str, Any]:
    """Audit the run in ``folder`` (module docstring); returns what ``audit.json`` holds."""
    config = from_dict(read_run_config(folder))
    hf = config.model.hf_checkpoint
    chat = ChatTokenizer.from_dir(start_policy(folder, hf))
    by_key: dict[tuple[int, str], list[AuditSequence]] = defaultdict(list)
    failed = 0
    for line in read_rollouts(folder, step):
        failed += line["status"] == "failed"  # its chains were still sampled: audited
        key = (int(line["version"]), json.dumps(line["sampling"], sort_keys=True))
        by_key[key] += [
            AuditSequence(r["ids"], r["loss_mask"], r["logprobs"]) for r in line["rows"]
        ]
    versions: dict[str, Any] = {}
    total = AuditReport()
    for (version, sampling), sequences in sorted(by_key.items()):
        engine = schema.trainer_config(config, Path(), **json.loads(sampling))
        trainer = trainer_at_version(folder, version, engine, hf)
        report = audit(
            trainer, sequences, retokenize=lambda ids: chat.encode(chat.decode(ids)), window=WINDOW
        )
        trainer.close()
        versions[str(version)] = report.summary()
        total = total.merge(report)
    result = {"step": step, "failed_episodes": failed, "window": WINDOW, **total.summary()}
    result["versions"] = versions
    (folder / "audit.json").write_text(json.dumps(result, indent=2) + "\n")
    if console is not None:
        console.print(table(result))
        console.print(f"written: {folder / 'audit.json'}")
    return result


def table(result: dict[str, Any]) -> Table:
    """The audit as a rich table: one row per weight version, then all."""
    out = Table(title="trajectory audit: |trainer - behaviour| log-prob gap; turn boundaries")
    for name in ("version", "seqs", "tokens", "p50", "p90", "p99", "max",
                 "bounds", "bnd max", "bnd mism", "tok mism"):  # fmt: skip
        out.add_column(name, justify="right")
    for name, r in [*result["versions"].items(), ("all", result)]:
        gap, bgap = r["gap"] or {}, r["boundary_gap"] or {}
        out.add_row(
            name, str(r["sequences"]), str(r["tokens"]),
            *(f"{gap[q]:.1e}" if gap else "-" for q in ("p50", "p90", "p99", "max")),
            str(r["boundaries"]), f"{bgap['max']:.1e}" if bgap else "-",
            str(r["boundary_mismatches"]), str(r["token_mismatches"]),
        )  # fmt: skip
    return out


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``uv run apps/agent audit ...``."""
    parser = argparse.ArgumentParser(
        prog="apps/agent audit",
        description="Replay a run's saved trajectories through the trainer at the weight "
        "version that sampled them; report the trainer-behaviour log-prob gap and token "
        f"mismatches at turn boundaries (exported ids that differ, within {WINDOW} tokens of "
        "a loss-mask change, from a fresh tokenisation of the conversation's text); writes "
        "audit.json in the run folder.",
    )
    parser.add_argument("--run-dir", required=True, type=Path, help="the run folder")
    parser.add_argument(
        "--step", type=int, default=None, help="only step N's rollout (trajectories/step-N.jsonl)"
    )
    return parser
