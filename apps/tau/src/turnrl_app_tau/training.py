"""The policy model, its SFT warm-up on gold conversations, the GRPO trainer and engines.

- :func:`build_policy`: ``--hf-checkpoint`` as given, or a tiny Qwen3 (seeded random
  weights, a small BPE tokenizer with the Qwen chat template) built in the run folder.
- :func:`sft_warm_up`: SFT with loss on assistant tokens only, on every training task's
  gold conversation (``turnrl.tool_envs.tau.gold``), exported as a Hugging Face folder the
  engines reload.
- :func:`trainer_config`, :func:`engine_spec`: what every GRPO trainer (here or on each Ray
  rank) and every engine are built from (``turnrl.grpo_core.recipe.schema``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.model import policy_start
from turnrl.grpo_core.recipe.sft import SFT_DONE, train_sft_on_chats
from turnrl.grpo_core.training.torch_engine import TorchEngineConfig
from turnrl.rollout_router.engine import EngineSpec
from turnrl.tool_envs.tau_data import TaskData, extra_store_conversations, store_conversations
from turnrl_app_tau.config import TauAppConfig
from turnrl_app_tau.report import console


def build_policy(config: TauAppConfig, run_dir: Path, reuse: bool = False) -> Path:
    """The starting model: ``--hf-checkpoint``, or a tiny Qwen3 built in the run folder."""
    positions = max(4096, config.rollout.rollout_max_context_len)
    folder = run_dir / "model" / "base"
    return policy_start(config, folder, max_positions=positions, reuse=reuse, console=console)


def sft_warm_up(
    config: TauAppConfig,
    base: Path,
    data: TaskData,
    tools: list[dict[str, Any]],
    run_dir: Path,
    reuse: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> Path:
    """SFT on the training tasks' gold conversations; returns the exported folder (or ``base``).

    With ``reuse``, a complete SFT model an earlier run of ``run_dir`` exported is returned
    without training. ``on_step`` gets every step's metrics (``sft/loss``, ``sft/probe``).
    """
    t, sft = config.tau, config.sft
    if not sft.runs or not data.train:
        console.print("SFT warm-up skipped")
        return base
    done = run_dir / "model" / "sft" / SFT_DONE
    if reuse and done.is_file():
        console.print(f"SFT: reusing {done.parent} ({done.read_text().strip()})")
        return done.parent
    conversations = [data.conversation(task) for task in data.train]
    if t.sft_extra_stores and t.domain == "synthetic":
        conversations += extra_store_conversations(t, t.sft_extra_stores)
    elif t.sft_extra_stores:
        console.print(f"SFT: sft_extra_stores={t.sft_extra_stores} ignored (synthetic domain only)")
    probe_chats: list[list[dict[str, Any]]] = []
    if sft.probe_target:
        if t.domain == "synthetic":  # a store SFT never sees
            probe_chats = store_conversations(t, t.sft_extra_stores + 1)[: sft.probe_size]
        else:  # the last training conversations, left out of SFT
            probe_chats = conversations[-sft.probe_size :]
            conversations = conversations[: -sft.probe_size]
    # A curriculum: the first turns of every conversation, then all of it.
    prefixes = [prefix(messages, t.sft_prefix_turns) for messages in conversations]
    first = [(t.sft_prefix_steps, prefixes, t.sft_prefix_batch_size)] if t.sft_prefix_steps else []
    train_sft_on_chats(
        config,
        base,
        conversations,
        probe_chats,
        done.parent,
        tools=tools,
        first=first,
        console=console,
        on_step=on_step,
    )
    return done.parent


def prefix(messages: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    """``messages`` cut right after the ``turns``-th assistant message (all if fewer)."""
    seen = 0
    for index, message in enumerate(messages):
        seen += message["role"] == "assistant"
        if seen == turns:
            return messages[: index + 1]
    return list(messages)


def trainer_config(config: TauAppConfig, policy: Path) -> TorchEngineConfig:
    """What every GRPO trainer (the local one, or each Ray rank) builds from ``policy``
    (``turnrl.grpo_core.recipe.schema.trainer_config``), sampling as the rollouts do."""
    return schema.trainer_config(config, policy, temperature=config.rollout.rollout_temperature)


def engine_spec(config: TauAppConfig, model: Path) -> EngineSpec:
    """One inference engine serving ``model`` (``turnrl.grpo_core.recipe.schema``)."""
    t, extra = config.tau, []
    if t.user_model == "local" and t.benchmark == "tau2" and t.domain == "telecom":
        # The engines also play telecom's user, who calls the phone's tools: the chat route
        # must parse tool calls (Qwen3 writes hermes-style <tool_call> blocks).
        args = config.engine.extra_args
        if "--enable-auto-tool-choice" not in args:
            extra.append("--enable-auto-tool-choice")
        if not any(a.startswith("--tool-call-parser") for a in args):
            extra += ["--tool-call-parser", "hermes"]
    spec: EngineSpec = schema.engine_spec(
        config, model, config.rollout.rollout_max_context_len, extra
    )
    return spec
