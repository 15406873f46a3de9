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

from turnrl.grpo_core.recipe.flags import add_config_flags, add_run_flags, resolve_fields
from turnrl.grpo_core.recipe.run_folder import config_from_dict
from turnrl.grpo_core.recipe.schema import check_schema, refusals
from turnrl_app_retool.config import PRESET_DIR, RetoolAppConfig, preset


def build_parser() -> argparse.ArgumentParser:
    """The app's argument parser (a flag not given keeps the preset's value)."""
    parser = argparse.ArgumentParser(
        prog="uv run apps/retool",
        description="ReTool: SFT, then GRPO with a code sandbox, evaluated by mean@k and turns.",
    )
    add_run_flags(parser, PRESET_DIR)
    add_config_flags(parser, RetoolAppConfig)
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
        check_schema(config, refusals(config))
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return config, args
