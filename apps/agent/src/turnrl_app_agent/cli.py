"""Command line of the agent app: each flag sets one field of :class:`AgentAppConfig`
(declared on the field, ``turnrl.grpo_core.settings``).

A flag overrides the preset (preset < flags; a resumed run: its config.json < flags).
Subcommands: ``train`` (the default) and ``eval`` (the held-out tasks only); ``audit`` has
its own flags (``turnrl_app_agent.audit.build_parser``, dispatched in ``main``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.grpo_core.recipe.flags import add_config_flags, add_run_flags, resolve_fields
from turnrl_app_agent.config import PRESET_DIR, AgentAppConfig, from_dict, preset


@dataclass
class Invocation:
    """A parsed command line."""

    command: str
    """train or eval."""
    config: AgentAppConfig
    resume: bool = False
    """Continue the interrupted run in ``config.run_dir`` (``--resume``)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``uv run apps/agent [train|eval] ...``."""
    parser = argparse.ArgumentParser(
        prog="apps/agent",
        description=__doc__.split("\n")[0],
        epilog="apps/agent audit --run-dir DIR [--step N]: replay a run's saved trajectories "
        "through the trainer (apps/agent audit --help)",
    )
    parser.add_argument("command", nargs="?", choices=["train", "eval"], default="train")
    add_run_flags(parser, PRESET_DIR)
    add_config_flags(parser, AgentAppConfig)
    return parser


def resolve(argv: Sequence[str] | None = None) -> Invocation:
    """Parse ``argv`` and resolve preset < flags; ``--agent`` or ``--agent-command`` given
    as a flag replaces the preset's other one.

    Raises:
        SystemExit: argparse's exit on a malformed command line (message on stderr).
        ValueError: a value a config section rejects, or both --smoke and another preset.
    """
    args = vars(build_parser().parse_args(list(argv) if argv is not None else None))
    command, resume = args.pop("command"), args["resume"]
    given = {"agent.agent", "agent.agent_command"} & set(args)
    data = resolve_fields(args, preset)
    if given == {"agent.agent"}:  # a flag's agent replaces the preset's, of either kind
        data["agent"]["agent_command"] = None
    elif given == {"agent.agent_command"}:
        data["agent"]["agent"] = None
    return Invocation(command, from_dict(data), resume)
