"""The policy model, its SFT warm-up on gold conversations, the GRPO trainer and the user.

- :func:`build_policy`: ``--hf-checkpoint`` as given, or a tiny Qwen3 (seeded random
  weights, a small BPE tokenizer with the Qwen chat template) built in the run folder.
- :func:`sft_warm_up`: SFT with loss on assistant tokens only, on every training task's
  gold conversation (``turnrl.tool_envs.tau.gold``), exported as a Hugging Face folder the
  engines reload.
- :func:`trainer_config`, :func:`engine_spec`: what every GRPO trainer (here or on each Ray
  rank) and every engine are built from (``turnrl.grpo_core.recipe.schema``).
- :func:`make_user_factory`: the scripted customer, or an LLM user through litellm (a
  provider model, or ``local``: the policy engines themselves, as vime does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.model import policy_start
from turnrl.grpo_core.recipe.sft import SFT_DONE, SFTPhase, train_sft
from turnrl.grpo_core.training.sft import build_sft_example
from turnrl.grpo_core.training.torch_engine import TorchEngineConfig
from turnrl.rollout_router.engine import EngineSpec
from turnrl.tool_envs.protocol import UserSimulator
from turnrl.tool_envs.tau.gold import TaskUser
from turnrl_app_tau.config import TauAppConfig
from turnrl_app_tau.data import (
    TaskData,
    extra_store_conversations,
    store_conversations,
)
from turnrl_app_tau.report import console


def build_policy(config: TauAppConfig, run_dir: Path, reuse: bool = False) -> Path:
    """The starting model: ``--hf-checkpoint``, or a tiny Qwen3 built in the run folder."""
    positions = max(4096, config.rollout.rollout_max_context_len)
    folder = run_dir / "model" / "base"
    return policy_start(config, folder, max_positions=positions, reuse=reuse, console=console)


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


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
    tok = _tokenizer(base)
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
    length = config.parallel.seq_length
    probe = [build_sft_example(tok, m, tools, max_length=length) for m in probe_chats]
    examples = [build_sft_example(tok, m, tools, max_length=length) for m in conversations]
    prefixes = [
        build_sft_example(tok, prefix(messages, t.sft_prefix_turns), tools)
        for messages in conversations
        if t.sft_prefix_steps
    ]
    tokens = sum(len(e.input_ids) for e in examples) / len(examples)
    console.print(
        f"SFT: {len(examples)} gold conversations, {tokens:.0f} tokens on average, "
        f"{t.sft_prefix_steps} prefix steps x {t.sft_prefix_batch_size} + "
        f"{sft.num_steps} steps x {sft.global_batch_size}"
    )
    # A curriculum: the first turns of every conversation, then all of it.
    first = [SFTPhase(t.sft_prefix_steps, prefixes, t.sft_prefix_batch_size, probe=False)]
    train_sft(
        config,
        base,
        examples,
        probe,
        done.parent,
        pad_id=tok.pad_token_id,
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
    (``turnrl.grpo_core.recipe.schema.trainer_config``).

    Raises:
        ValueError: a setting the megatron engine cannot honour, naming its flag.
    """
    return schema.trainer_config(
        config,
        policy,
        optimizer=config.optimizer,
        loss=config.loss,
        temperature=config.rollout.rollout_temperature,
    )


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


def make_user_factory(config: TauAppConfig, engine_urls: list[str]) -> Callable[[], UserSimulator]:
    """Scripted users by default; an LLM user through litellm with ``--user-model``."""
    t = config.tau
    if t.user_model is None:
        return TaskUser
    from turnrl.tool_envs.user_sim import LiteLLMUser, LiteLLMUserConfig

    model, api_base = t.user_model, None
    if model == "local":  # the policy engines serve the user too (vime's default)
        model, api_base = "openai/policy", f"{engine_urls[0]}/v1"
    user_config = LiteLLMUserConfig(
        model=model, api_base=api_base, max_retries=t.user_retries, backoff_s=t.user_retry_delay
    )
    if t.benchmark == "tau2" and t.tau2_dir:  # tau2's own user guidelines around the scenario
        from turnrl.tool_envs.tau2.llm import user_prompt

        user_config.system_prompt = user_prompt(t.tau2_dir, with_tools=t.domain == "telecom")
    return lambda: LiteLLMUser(user_config)


def make_judge(config: TauAppConfig, engine_urls: list[str]) -> Any:
    """tau2's NL-assertion judge (``--judge-model``; ``local``: the engines), or None."""
    t = config.tau
    if t.benchmark != "tau2" or t.judge_model is None:
        return None
    from turnrl.tool_envs.tau2.llm import LiteLLMJudge
    from turnrl.tool_envs.user_sim import LiteLLMUserConfig

    model, api_base = t.judge_model, None
    if model == "local":
        model, api_base = "openai/policy", f"{engine_urls[0]}/v1"
    judge_config = LiteLLMUserConfig(
        model=model,
        api_base=api_base,
        max_retries=t.user_retries,
        backoff_s=t.user_retry_delay,
        max_tokens=2048,
    )
    return LiteLLMJudge(judge_config)
