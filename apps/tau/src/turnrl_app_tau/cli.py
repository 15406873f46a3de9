"""Command line of the tau app: slime/vime flag names mapped onto :class:`TauAppConfig`.

Every flag of the vime tau-bench NPU script parses here and sets the config field with the
same meaning; a flag overrides the preset, and vime's ``TAU_*`` environment variables sit
between the two (preset < environment < flags). Subcommands: ``train`` (the default) and
``eval`` (pass^k over a split, with ``--num-trials`` and ``--max-concurrency`` as in
tau-bench's runner).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.grpo_core.recipe.flags import (
    OFF,
    ON,
    RUN_FLAGS,
    add_flags,
    add_run_flags,
    comma_list,
    env_fields,
    resolve_fields,
)
from turnrl.grpo_core.recipe.schema import SCHEMA_FLAG_OF, SCHEMA_FLAGS, add_schema_flags
from turnrl.grpo_core.recipe.sft import SFT_FLAGS
from turnrl_app_tau.config import PRESET_DIR, TauAppConfig, from_dict, preset

# (flag, "section.field", kind): kinds as in turnrl.grpo_core.recipe.flags; the script's
# flags of the model, cluster and parallelism sections are grpo-core's SCHEMA_FLAGS.
_SCRIPT_FLAGS: list[tuple[str, str, Any]] = [
    ("--custom-generate-function-path", "rollout.custom_generate_function_path", str),
    ("--custom-rm-path", "rollout.custom_rm_path", str),
    ("--prompt-data", "tau.prompt_data", str),
    ("--input-key", "tau.input_key", str),
    ("--rollout-max-response-len", "rollout.rollout_max_response_len", int),
    ("--rollout-max-context-len", "rollout.rollout_max_context_len", int),
    ("--rollout-temperature", "rollout.rollout_temperature", float),
]


_APP_FLAGS: list[tuple[str, str, Any, str]] = [
    *SFT_FLAGS,
    ("--tau-bench-dir", "tau.tau_bench_dir", str, "tau-bench data folder (<domain>/ inside)"),
    ("--domain", "tau.domain", str, "retail, airline or synthetic (tau2: airline or retail)"),
    ("--benchmark", "tau.benchmark", str, "tau (tau-bench) or tau2 (tau2-bench)"),
    ("--tau2-dir", "tau.tau2_dir", str, "tau2-bench data folder (<domain>/, user_simulator/)"),
    ("--judge-model", "tau.judge_model", str, "tau2 NL-assertion judge (litellm, or local)"),
    ("--split", "tau.split", str, "task split: train, test or dev"),
    ("--task-start", "tau.task_start", int, "first task index"),
    ("--task-end", "tau.task_end", int, "one past the last task index"),
    ("--num-heldout", "tau.num_heldout", int, "held-out tasks (tau2: first N of test, 0 all)"),
    ("--user-model", "tau.user_model", str, "litellm user model (local: the engines)"),
    ("--max-turns", "rollout.max_turns", int, "model turns per episode (TAU_MAX_TURNS)"),
    ("--max-inflight", "rollout.max_inflight", int, "episodes in flight (TAU_MAX_INFLIGHT)"),
    ("--short-tools", "rollout.short_tools", ON, "tool schemas without descriptions"),
    ("--sft-extra-stores", "tau.sft_extra_stores", int, "other synthetic stores in the SFT data"),
    ("--no-sft-train-tasks", "tau.sft_train_tasks", OFF, "SFT on the extra stores only"),
    ("--sft-train-tasks", "tau.sft_train_tasks", ON, "the training tasks in the SFT data too"),
    ("--no-policy-in-prompt", "tau.policy_in_prompt", OFF, "one-line system prompt"),
    ("--no-tools-in-prompt", "rollout.tools_in_prompt", OFF, "no tool schemas in the prompt"),
    ("--synthetic-num-tasks", "tau.synthetic_num_tasks", int, "synthetic tasks (train + held-out)"),
    ("--synthetic-num-users", "tau.synthetic_num_users", int, "synthetic customers"),
    ("--synthetic-kinds", "tau.synthetic_kinds", comma_list, "task kinds, comma-separated"),
    ("--num-trials", "tau.eval_trials", int, "trials per evaluation task (pass^k up to this k)"),
    ("--max-concurrency", "tau.eval_concurrency", int, "evaluation episodes in flight"),
    ("--eval-temperature", "tau.eval_temperature", float, "evaluation temperature (0 greedy)"),
    ("--tau-reward", "rollout.tau_reward", str, "training reward: shaped-group-max or task"),
]
_ENV_VARS: list[tuple[str, str, Any]] = [
    ("TAU_MAX_TURNS", "rollout.max_turns", int),
    ("TAU_MAX_INFLIGHT", "rollout.max_inflight", int),
    ("TAU_SHORT_TOOLS", "rollout.short_tools", lambda v: v.strip() not in ("", "0", "false")),
    ("TAU_USER_LITELLM_RETRIES", "tau.user_retries", int),
    ("TAU_USER_LITELLM_RETRY_DELAY", "tau.user_retry_delay", float),
]
_NOT_IN_SCRIPT = (
    *("--device", "--runner", "--dtype", "--torch-threads", "--micro-batch-size", "--async"),
    *("--max-off-policy-steps", "--eval-interval", "--save-interval", "--lr-warmup-iters"),
    *("--adam-eps", "--loss-agg-mode", "--rewards-normalization", "--router-read-timeout"),
    *("--eps-clip-c", "--calculate-per-token-loss", "--use-tis", "--tis-clip"),
    "--engine-api-server-cores",
)
SCRIPT_FLAGS: tuple[str, ...] = tuple(
    f
    for f, _, _ in [*_SCRIPT_FLAGS, *SCHEMA_FLAGS]
    if not f.startswith(("--tiny-", *_NOT_IN_SCRIPT))
)
"""Every flag of the vime tau-bench NPU script (model-architecture flags aside)."""
FLAG_OF: dict[str, str] = {
    **SCHEMA_FLAG_OF,
    **{dotted: flag for flag, dotted, _, _ in [*RUN_FLAGS, *_APP_FLAGS]},
    **{dotted: flag for flag, dotted, _ in _SCRIPT_FLAGS},
}
"""The command-line flag that sets each config field ("section.field")."""


@dataclass
class Invocation:
    """A parsed command line."""

    command: str
    """train or eval."""
    config: TauAppConfig
    """The resolved configuration."""
    resume: bool = False
    """Continue the interrupted run in ``config.run_dir`` (``--resume``)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``uv run apps/tau [train|eval] ...``."""
    parser = argparse.ArgumentParser(prog="apps/tau", description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", choices=["train", "eval"], default="train")
    add_run_flags(parser, PRESET_DIR)
    add_flags(parser.add_argument_group("app"), _APP_FLAGS)
    script = parser.add_argument_group("slime/vime flags (same names and meaning)")
    add_flags(script, [(flag, dest, kind, f"sets {dest}") for flag, dest, kind in _SCRIPT_FLAGS])
    add_schema_flags(parser)
    return parser


_OTHER_STORES = {"tau.sft_extra_stores", "tau.sft_train_tasks"}
"""Settings of the synthetic domain's other-store SFT (``resolve`` drops a preset's for real data)."""


def resolve(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Invocation:
    """Parse ``argv`` and resolve preset < ``TAU_*`` environment < flags (a resumed run:
    its config.json < flags).

    Raises:
        SystemExit: argparse's exit on a malformed command line (message on stderr).
        ValueError: a value a config section rejects, or both --smoke and another preset.
    """
    args = vars(build_parser().parse_args(list(argv) if argv is not None else None))
    command, resume = args.pop("command"), args["resume"]
    from_env = env_fields(_ENV_VARS, os.environ if environ is None else environ)
    given = set(args) | set(from_env)
    data = resolve_fields(args, preset, from_env)
    tau = data["tau"]
    if not resume and tau["domain"] != "synthetic" and not given & _OTHER_STORES:
        # A preset's SFT on other generated stores (the CPU default's) is a plan for the
        # synthetic domain; real data has no other stores, so SFT trains on its tasks. The
        # same settings given as flags are checked (and refused) by TauSettings.
        tau.update(sft_extra_stores=0, sft_train_tasks=True)
    return Invocation(command, from_dict(data), resume)
