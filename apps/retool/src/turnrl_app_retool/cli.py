"""Command line of the ReTool app: a preset, then flags that override it.

    uv run apps/retool                                  # cpu-default
    uv run apps/retool --smoke                          # seconds per stage (CI)
    uv run apps/retool --preset qwen3-4b-npu --hf-checkpoint /models/Qwen3-4B-Instruct-2507 \\
        --sft-data retool_sft.parquet --train-data dapo-math-17k.parquet --val-data aime_2025.jsonl
    uv run apps/retool --sandbox-url http://sandbox:8080   # an external SandboxFusion server
    uv run apps/retool --resume --run-dir runs/retool-X     # continue an interrupted run

Flag names follow slime/verl where one exists (``--num-rollout``, ``--rollout-batch-size``,
``--n-samples-per-prompt``, ``--global-batch-size``, ``--eps-clip``, ``--eps-clip-high``,
``--use-kl-loss``, ``--kl-loss-coef``, ``--entropy-coef``, ``--lr``, ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from turnrl.grpo_core.recipe.flags import (
    BOOL,
    OFF,
    ON,
    RUN_FLAGS,
    Flag,
    add_flags,
    add_run_flags,
    resolve_fields,
)
from turnrl.grpo_core.recipe.run_folder import config_from_dict
from turnrl.grpo_core.recipe.schema import (
    NOT_HONOURED,
    SCHEMA_FLAG_OF,
    add_schema_flags,
    check_schema,
    refusals,
)
from turnrl.grpo_core.recipe.sft import SFT_FLAGS
from turnrl_app_retool.config import PRESET_DIR, RetoolAppConfig, preset

# (flag, "section.field", kind): each sets one field (turnrl.grpo_core.recipe.flags).
_VALUED: list[tuple[str, str, Any]] = [
    ("--sft-data", "data.sft_path", str),
    ("--train-data", "data.train_path", str),
    ("--num-sft-chats", "data.num_sft_chats", int),
    ("--num-train-problems", "data.num_train_problems", int),
    ("--num-val-problems", "data.num_val_problems", int),
    ("--rollout-temperature", "rl.temperature", float),
    ("--max-turns", "rl.max_turns", int),
    ("--max-response-length", "rl.max_response_length", int),
    ("--filter-metric", "rl.filter_metric", str),
    ("--gen-batch-size", "rl.gen_batch_size", int),
    ("--max-num-gen-batches", "rl.max_num_gen_batches", int),
    ("--overlong-buffer-len", "rl.overlong_buffer_len", int),
    ("--overlong-penalty-factor", "rl.overlong_penalty_factor", float),
    ("--n-val-samples", "eval.n", int),
    ("--max-val-problems", "eval.max_problems", int),
    ("--sandbox-url", "sandbox.url", str),
]
FLAGS: list[Flag] = [
    *SFT_FLAGS,
    *[(flag, dest, kind, f"sets {dest}") for flag, dest, kind in _VALUED],
    ("--no-rl", "rl.enabled", OFF, "skip the RL stage"),
    ("--sandbox-insecure", "sandbox.insecure", ON, "let the sandbox run uncontained code"),
    ("--dynamic-sampling", "rl.dynamic_sampling", BOOL, "DAPO dynamic sampling filter on/off"),
    ("--tool-schema-in-prompt", "data.tool_schema_in_prompt", BOOL, "tool schema in prompts"),
]
"""Every app flag that sets a config field (``--val-data`` aside: it appends); the model,
cluster and parallelism flags are grpo-core's (``turnrl.grpo_core.recipe.schema``)."""
FLAG_OF = {**SCHEMA_FLAG_OF, **{dotted: flag for flag, dotted, _, _ in [*RUN_FLAGS, *FLAGS]}}
"""The command-line flag that sets each config field ("section.field")."""


def build_parser() -> argparse.ArgumentParser:
    """The app's argument parser (a flag not given keeps the preset's value)."""
    parser = argparse.ArgumentParser(
        prog="uv run apps/retool",
        description="ReTool: SFT, then GRPO with a code sandbox, evaluated by mean@k and turns.",
    )
    add_run_flags(parser, PRESET_DIR)
    parser.add_argument(
        "--val-data",
        dest="data.val_paths",
        action="append",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="AIME 2024/2025 file (repeatable); replaces the preset's",
    )
    add_flags(parser, FLAGS)
    add_schema_flags(parser)
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    return parser


def resolve(argv: Sequence[str] | None = None) -> tuple[RetoolAppConfig, argparse.Namespace]:
    """Parse ``argv`` into a validated config (preset, then flags) and the namespace.

    Raises:
        SystemExit: bad flags (argparse) or an invalid resulting config (exit code 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k != "print_config"}
    try:
        config = config_from_dict(RetoolAppConfig, resolve_fields(fields, preset))
        config.validate()
        check_schema(config, refusals(config, NOT_HONOURED, FLAG_OF))
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return config, args
