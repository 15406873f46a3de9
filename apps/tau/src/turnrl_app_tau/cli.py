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

from turnrl.grpo_core.recipe.flags import (
    add_config_flags,
    add_run_flags,
    env_fields,
    resolve_fields,
)
from turnrl_app_tau.config import PRESET_DIR, TauAppConfig, from_dict, preset


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
    add_config_flags(parser, TauAppConfig)
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
    from_env = env_fields(TauAppConfig, os.environ if environ is None else environ)
    given = set(args) | set(from_env)
    data = resolve_fields(args, preset, from_env)
    tau = data["tau"]
    if not resume and tau["domain"] != "synthetic" and not given & _OTHER_STORES:
        # A preset's SFT on other generated stores (the CPU default's) is a plan for the
        # synthetic domain; real data has no other stores, so SFT trains on its tasks. The
        # same settings given as flags are checked (and refused) by TauSettings.
        tau.update(sft_extra_stores=0, sft_train_tasks=True)
    return Invocation(command, from_dict(data), resume)
