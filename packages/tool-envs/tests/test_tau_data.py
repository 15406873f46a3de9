"""Tasks and domains of a tau run (``turnrl.tool_envs.tau.data``): the synthetic store and its
kind mixes, tau-bench folders, the short prompt, tool schemas, and the user simulator."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from turnrl.tool_envs.tau.data import (
    SHORT_SYSTEM_PROMPT,
    TauTaskConfig,
    extra_store_conversations,
    judge,
    load_tasks_and_domain,
    tool_schemas,
    user_factory,
)
from turnrl.tool_envs.tau.gold import TaskUser
from turnrl.tool_envs.tau.synth import TASK_KINDS

SMALL = TauTaskConfig(domain="synthetic", synthetic_num_tasks=12, num_heldout=4)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="domain"):
        load_tasks_and_domain(TauTaskConfig(domain="bank"))
    with pytest.raises(ValueError, match="--tau-bench-dir"):
        load_tasks_and_domain(TauTaskConfig(domain="retail"))
    with pytest.raises(FileNotFoundError):
        load_tasks_and_domain(TauTaskConfig(domain="retail", tau_bench_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="num_heldout"):
        load_tasks_and_domain(dataclasses.replace(SMALL, synthetic_num_tasks=4))
    with pytest.raises(ValueError, match="benchmark"):
        TauTaskConfig(benchmark="tau3")
    with pytest.raises(ValueError, match="--tau2-dir"):
        load_tasks_and_domain(TauTaskConfig(benchmark="tau2", domain="airline"))


def test_short_prompt_and_no_tool_schemas() -> None:
    policy = load_tasks_and_domain(SMALL)
    short = load_tasks_and_domain(dataclasses.replace(SMALL, policy_in_prompt=False))
    assert short.domain.wiki == SHORT_SYSTEM_PROMPT != policy.domain.wiki
    assert len(policy.domain.wiki) > 10 * len(SHORT_SYSTEM_PROMPT)
    assert tool_schemas(short, short=True, in_prompt=False) == []
    shown = {s["function"]["name"] for s in tool_schemas(short, short=True)}
    used = {a.name for t in short.train + short.heldout for a in t.actions}
    assert shown == used | {"transfer_to_human_agents"}  # the synthetic store shows what it uses
    assert len(shown) < len(short.domain.schemas)


def test_extra_stores_hold_none_of_the_heldout_orders() -> None:
    settings = dataclasses.replace(SMALL, synthetic_kinds=["status", "cancel"])
    data = load_tasks_and_domain(settings)
    extra = extra_store_conversations(settings, 2)
    assert len(extra) == 2 * settings.synthetic_num_tasks
    assert all(c[0] == {"role": "system", "content": data.domain.wiki} for c in extra)
    heldout = {t.actions[1].kwargs["order_id"] for t in data.heldout}
    mentioned = {
        json.loads(m["tool_calls"][0]["function"]["arguments"]).get("order_id")
        for c in extra
        for m in c
        if m.get("tool_calls")
    }
    assert mentioned and not heldout & mentioned
    assert extra_store_conversations(settings, 0) == []


_DATA_DIGEST = """
import hashlib, json
from turnrl.tool_envs.tau.data import TauTaskConfig, load_tasks_and_domain
from turnrl.tool_envs.tau.gold import gold_conversation
settings = TauTaskConfig(domain="synthetic", synthetic_num_tasks=12, num_heldout=4,
                         synthetic_kinds=["status", "cancel"])
data = load_tasks_and_domain(settings)
train = [gold_conversation(data.domain, t, data.domain.wiki) for t in data.train]
heldout = [t.instruction for t in data.heldout]
print(hashlib.sha256(json.dumps([train, heldout], default=str).encode()).hexdigest())
"""


def test_synthetic_tasks_do_not_depend_on_the_hash_seed() -> None:
    """The split and the SFT data order are the same in every process (a set of kinds once
    made them follow PYTHONHASHSEED, so one seed gave different SFT models)."""
    digests = set()
    for hash_seed in ("0", "1", "2", "3", "4", "5"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run(
            [sys.executable, "-c", _DATA_DIGEST], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        digests.add(run.stdout.strip())
    assert len(digests) == 1


def test_task_kinds_mix_is_even_and_held_out_is_new() -> None:
    settings = TauTaskConfig(
        domain="synthetic",
        synthetic_kinds=["status", "cancel"],
        synthetic_num_users=60,
        synthetic_num_tasks=40,
        num_heldout=10,
    )
    data = load_tasks_and_domain(settings)
    names = [t.actions[-1].name for t in data.train + data.heldout]
    assert set(names) == {TASK_KINDS["status"], TASK_KINDS["cancel"]}
    assert names.count(TASK_KINDS["status"]) == names.count(TASK_KINDS["cancel"]) == 20
    held = {t.actions[-1].name for t in data.heldout}
    assert held == {TASK_KINDS["status"], TASK_KINDS["cancel"]}

    def key(task: Any) -> tuple[str, str]:
        return task.actions[-1].name, task.actions[1].kwargs["order_id"]

    assert not {key(t) for t in data.heldout} & {key(t) for t in data.train}
    assert "status+cancel" in data.source


def test_task_kinds_bad_input() -> None:
    with pytest.raises(ValueError, match="synthetic_kinds"):
        load_tasks_and_domain(TauTaskConfig(domain="synthetic", synthetic_kinds=["refund"]))
    with pytest.raises(ValueError, match="synthetic_kinds"):
        load_tasks_and_domain(TauTaskConfig(domain="synthetic", synthetic_kinds=[]))
    too_many = TauTaskConfig(
        domain="synthetic",
        synthetic_kinds=["cancel"],
        synthetic_num_users=2,
        synthetic_num_tasks=40,
        num_heldout=4,
    )
    with pytest.raises(ValueError, match="distinct synthetic tasks"):
        load_tasks_and_domain(too_many)


def test_the_user_is_scripted_unless_an_llm_is_named_and_local_means_the_engines() -> None:
    urls = ["http://127.0.0.1:9"]
    assert user_factory(SMALL, urls) is TaskUser
    llm = dataclasses.replace(SMALL, user_model="local", user_retries=3, user_retry_delay=0.5)
    user = user_factory(llm, urls)()
    config = user.config  # type: ignore[attr-defined]
    assert (config.model, config.api_base) == ("openai/policy", "http://127.0.0.1:9/v1")
    assert (config.max_retries, config.backoff_s) == (3, 0.5)
    provider = user_factory(dataclasses.replace(SMALL, user_model="openai/gpt-4o-mini"), urls)()
    assert provider.config.model == "openai/gpt-4o-mini"  # type: ignore[attr-defined]
    assert provider.config.api_base is None  # type: ignore[attr-defined]
    assert judge(dataclasses.replace(SMALL, judge_model="local"), urls) is None  # tau-bench: none


def test_engines_playing_the_telecom_user_parse_tool_calls() -> None:
    from turnrl.tool_envs.tau.data import TauTaskConfig, engine_args

    telecom = TauTaskConfig(benchmark="tau2", domain="telecom", user_model="local")
    assert engine_args(telecom, []) == [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    given = ["--enable-auto-tool-choice", "--tool-call-parser=llama3_json"]
    assert engine_args(telecom, given) == []  # the user's own choice stands
    scripted = dataclasses.replace(telecom, user_model=None)  # the engines play no user
    assert engine_args(scripted, []) == []
    assert engine_args(dataclasses.replace(telecom, domain="airline"), []) == []
