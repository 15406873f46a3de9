"""Tau2Env's routing, endings and scoring on a small two-sided domain written here.

The domain is real code of this package's kind (a ``Toolkit`` pair and a ``sync``), small
enough to reason about: a shop counter (agent side) and a wallet (user side).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from turnrl.tool_envs.tau.tau2.domain import Tau2Domain
from turnrl.tool_envs.tau.tau2.env import GREETING, Tau2Env, Tau2EnvConfig
from turnrl.tool_envs.tau.tau2.tasks import TaskFormatError, Tau2Task, load_tasks, render_scenario
from turnrl.tool_envs.tau.tau2.toolkit import Model, ToolKind, Toolkit, deep_merge, tool
from turnrl.tool_envs.user_sim import ScriptedUser

needs_litellm = pytest.mark.skipif(
    importlib.util.find_spec("litellm") is None or importlib.util.find_spec("aiohttp") is None,
    reason="litellm and aiohttp are not installed (pip install 'turnrl-tool-envs[litellm]' aiohttp)",
)


class ChatServer:
    """An OpenAI-compatible chat server (for the ``serve`` fixture) answering its scripted
    messages in turn; HTTP 500 to the requests numbered in ``fail`` (1-based)."""

    def __init__(self, messages: list[dict[str, Any]], fail: frozenset[int] = frozenset()) -> None:
        self.messages, self.fail = messages, fail
        self.requests: list[dict[str, Any]] = []

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        served = sum(1 for n in range(1, len(self.requests)) if n not in self.fail)
        return self.messages[min(served, len(self.messages) - 1)]

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        if len(self.requests) in self.fail:
            return web.json_response({"error": {"message": "overloaded"}}, status=500)
        choice = {"index": 0, "finish_reason": "stop", "message": self.answer(body)}
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [choice],
            }
        )


_ID = {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}


class Shop(Toolkit):
    def __init__(self, db: dict[str, Any]) -> None:
        self.db = db

    def state(self) -> Any:
        return self.db

    def update_db(self, data: dict[str, Any]) -> None:
        deep_merge(self.db, data)

    @tool(ToolKind.READ, "Look up an item.", _ID)
    def get_item(self, item: str) -> Model:
        if item not in self.db["items"]:
            raise ValueError(f"Item {item} not found")
        return Model(self.db["items"][item])

    @tool(ToolKind.WRITE, "Sell an item.", _ID)
    def sell(self, item: str) -> str:
        self.get_item(item)
        self.db["items"][item]["sold"] = True
        return "sold"

    def assert_sold(self, item: str) -> bool:
        return bool(self.db["items"][item]["sold"])


class Wallet(Toolkit):
    side = "user"

    def __init__(self, db: dict[str, Any]) -> None:
        self.db = db

    def state(self) -> Any:
        return self.db

    def update_db(self, data: dict[str, Any]) -> None:
        deep_merge(self.db, data)

    @tool(ToolKind.WRITE, "Pay what is owed.")
    def pay(self) -> str:
        self.db["paid"] = True
        return "paid"

    @tool(ToolKind.READ, "Check the balance.")
    def balance(self) -> int:
        return 10


def _shop_domain() -> Tau2Domain:
    def sync(shop: Toolkit, wallet: Toolkit | None) -> None:
        assert isinstance(shop, Shop) and isinstance(wallet, Wallet)
        wallet.db["owes"] = (
            any(i["sold"] for i in shop.db["items"].values()) and not wallet.db["paid"]
        )

    return Tau2Domain(
        name="shop",
        policy="Sell things.",
        new_tools=lambda: Shop({"items": {"a": {"price": 3, "sold": False}}}),
        new_user_tools=lambda: Wallet({"paid": False, "owes": False}),
        sync=sync,
    )


def _task(**criteria: Any) -> Tau2Task:
    record = {
        "id": "t1",
        "user_scenario": {"persona": "Calm.", "instructions": "Buy item a."},
        "evaluation_criteria": {
            "actions": [
                {"name": "sell", "arguments": {"item": "a"}},
                {"name": "pay", "requestor": "user"},
            ],
            "reward_basis": ["DB"],
            **criteria,
        },
    }
    return Tau2Task.from_dict(record)


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [_tc(name, arguments)]}


def _tc(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"c-{name}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


class WalletUser(ScriptedUser):
    """A scripted user that pays with its wallet tool when the agent asks it to."""

    def __init__(self, replies: list[Any]) -> None:
        super().__init__(["x"])
        self.replies, self.results, self.schemas = list(replies), [], []

    def use_tools(self, schemas: list[dict[str, Any]]) -> None:
        self.schemas = schemas

    async def reset(self, instruction: str) -> Any:
        self.instruction = instruction
        return self.replies.pop(0)

    async def respond(self, agent_message: str) -> Any:
        return self.replies.pop(0)

    async def tool_results(self, messages: list[dict[str, Any]]) -> Any:
        self.results.append(messages)
        return self.replies.pop(0)


async def test_a_dual_control_episode_routes_calls_to_each_side_and_scores_the_db() -> None:
    pay = {"role": "assistant", "content": None, "tool_calls": [_tc("pay", {})]}
    user = WalletUser(["I want item a.", pay, "Paid. ###STOP###"])
    env = Tau2Env(_shop_domain(), user)
    opening = await env.reset(_task())
    assert [m["role"] for m in opening] == ["system", "assistant", "user"]
    assert opening[1]["content"] == GREETING and "Sell things." in opening[0]["content"]
    assert user.instruction == "Persona:\n\tCalm.\nInstructions:\n\tBuy item a."
    assert [s["function"]["name"] for s in user.schemas] == ["balance", "pay"]
    sold = await env.step(_call("sell", item="a"))
    assert sold.observations[0]["content"] == "sold" and not sold.done
    assert env.phone is not None and env.phone.state()["owes"] is True  # synced after the call
    said = await env.step({"role": "assistant", "content": "Please pay with your wallet."})
    assert said.done and said.info["done_reason"] == "user_stop"
    assert said.observations == [
        {"role": "user", "content": "Paid. ###STOP###"}
    ]  # no user tools shown
    assert user.results[0][0]["content"] == "paid"
    roles = [m["role"] for m in env.conversation]
    assert roles == ["assistant", "user", "assistant", "tool", "assistant", "user", "tool", "user"]
    reward = env.reward()
    assert reward.reward == 1.0 and reward.breakdown["db_match"] is True


async def test_an_agent_that_skips_the_sale_fails_the_db_check() -> None:
    env = Tau2Env(_shop_domain(), WalletUser(["I want a.", "Bye ###STOP###"]))
    await env.reset(_task())
    await env.step({"role": "assistant", "content": "No."})
    assert env.reward().reward == 0.0


async def test_bad_calls_are_model_visible_errors_and_the_episode_goes_on() -> None:
    env = Tau2Env(_shop_domain(), WalletUser(["hi", "ok ###STOP###"]))
    await env.reset(_task())
    cases = [
        (_call("refund", item="a"), "Error: Tool 'refund' not found."),
        (_call("pay"), "Error: Tool 'pay' not found."),  # a user tool, called by the agent
        (_call("get_item", item="zz"), "Error: Item zz not found"),
        (_call("get_item"), "Error: "),
    ]
    for turn, text in cases:
        result = await env.step(turn)
        assert result.observations[0]["content"].startswith(text) and not result.done
    ok = await env.step(_call("get_item", item="a"))
    assert json.loads(ok.observations[0]["content"]) == {"price": 3, "sold": False}
    broken = await env.step({"role": "assistant", "content": "", "tool_call_errors": ["bad JSON"]})
    assert broken.observations == [{"role": "tool", "content": "Error: bad JSON"}]
    assert env.errors == 5


async def test_endings_other_than_a_stop_score_zero() -> None:
    env = Tau2Env(_shop_domain(), WalletUser(["hi"]), Tau2EnvConfig(max_errors=2))
    await env.reset(_task())
    await env.step(_call("sell", item="a"))
    await env.step(_call("nope"))
    last = await env.step(_call("nope"))
    assert last.done and last.info["done_reason"] == "too_many_errors"
    assert env.reward().reward == 0.0 and "too_many_errors" in env.reward().breakdown["note"]
    env = Tau2Env(_shop_domain(), WalletUser(["hi", "more?", "more?"]), Tau2EnvConfig(max_steps=5))
    await env.reset(_task())
    await env.step({"role": "assistant", "content": "Hello."})
    last = await env.step({"role": "assistant", "content": "Hello."})
    assert last.info["done_reason"] == "max_steps"


async def test_a_user_simulator_failure_fails_the_episode_unscored(
    qwen3: Any, make_engine: Any
) -> None:
    from turnrl.tool_envs.rollout import RolloutConfig, run_episode
    from turnrl.tool_envs.user_sim import UserSimulatorError

    class DownUser(WalletUser):
        async def respond(self, agent_message: str) -> Any:
            raise UserSimulatorError("user model unreachable after 3 tries")

    env = Tau2Env(_shop_domain(), DownUser(["hi"]))
    engine = make_engine(["Hello."])
    traj = await run_episode(engine, env, qwen3, _task(), RolloutConfig())
    assert traj.status == "failed" and "UserSimulatorError" in traj.metadata["error"]


async def test_initial_state_and_env_assertions() -> None:
    record = {
        "id": "t2",
        "user_scenario": {
            "instructions": {
                "domain": "shop",
                "reason_for_call": "buy",
                "task_instructions": "be brief",
            }
        },
        "initial_state": {
            "initialization_data": {"agent_data": {"items": {"b": {"price": 1, "sold": False}}}},
            "initialization_actions": [
                {"env_type": "assistant", "func_name": "sell", "arguments": {"item": "b"}}
            ],
        },
        "evaluation_criteria": {
            "actions": None,
            "env_assertions": [
                {"env_type": "assistant", "func_name": "assert_sold", "arguments": {"item": "b"}},
                {
                    "env_type": "assistant",
                    "func_name": "assert_sold",
                    "arguments": {"item": "a"},
                    "assert_value": False,
                },
            ],
            "reward_basis": ["ENV_ASSERTION"],
        },
    }
    task = Tau2Task.from_dict(record)
    assert task.scenario.startswith("Instructions:\n\tDomain: shop\n\tReason for call:\n\t\tbuy")
    env = Tau2Env(_shop_domain(), WalletUser(["hi", "bye ###STOP###"]))
    await env.reset(task)
    assert env.phone is not None and env.phone.state()["owes"] is True  # init action, then sync
    await env.step({"role": "assistant", "content": "Done."})
    assert env.assertions() == (True, True) and env.reward().reward == 1.0


def test_broken_task_records_and_files_are_refused(tmp_path: Any) -> None:
    with pytest.raises(TaskFormatError, match=r"'t9'.*user_scenario"):
        Tau2Task.from_dict({"id": "t9"})
    with pytest.raises(TaskFormatError, match="env_type"):
        Tau2Task.from_dict(
            {
                "id": "t9",
                "user_scenario": {"instructions": "x"},
                "initial_state": {
                    "initialization_actions": [{"env_type": "admin", "func_name": "f"}]
                },
            }
        )
    with pytest.raises(TaskFormatError, match="unknown reward_basis"):
        Tau2Task.from_dict(
            {
                "id": "t9",
                "user_scenario": {"instructions": "x"},
                "evaluation_criteria": {"reward_basis": ["X"]},
            }
        )
    with pytest.raises(TaskFormatError, match="missing"):
        load_tasks(tmp_path)
    (tmp_path / "tasks.json").write_text("[{", encoding="utf-8")
    with pytest.raises(TaskFormatError, match="not valid JSON"):
        load_tasks(tmp_path)
    (tmp_path / "tasks.json").write_text('[{"id": "1", "user_scenario": {"instructions": "x"}}]')
    (tmp_path / "split_tasks.json").write_text('{"train": ["1", "2"]}')
    with pytest.raises(TaskFormatError, match=r"not in tasks\.json"):
        load_tasks(tmp_path, "train")
    with pytest.raises(TaskFormatError, match="no split 'test'"):
        load_tasks(tmp_path, "test")


def test_every_task_of_the_data_loads(tau2_data: Any) -> None:
    counts = {d: len(load_tasks(tau2_data / d)) for d in ("airline", "retail", "telecom")}
    assert counts == {"airline": 50, "retail": 114, "telecom": 2285}
    assert {
        d: len(load_tasks(tau2_data / d, "base")) for d in ("airline", "retail", "telecom")
    } == {
        "airline": 50,
        "retail": 114,
        "telecom": 114,
    }
    assert render_scenario({"instructions": "x"}) == "Instructions:\n\tx"


@needs_litellm
async def test_the_litellm_judge_retries_and_parses_or_refuses(serve: Any) -> None:
    from turnrl.rewards.tau2 import JudgeFormatError
    from turnrl.tool_envs.tau.tau2.llm import LiteLLMJudge
    from turnrl.tool_envs.user_sim import LiteLLMUserConfig

    verdict = {"results": [{"expectedOutcome": "a", "reasoning": "r", "metExpectation": False}]}
    texts = [json.dumps(verdict), "I think so."]
    server = ChatServer([{"role": "assistant", "content": t} for t in texts], fail=frozenset({1}))
    config = LiteLLMUserConfig(model="openai/judge", api_base=await serve(server), backoff_s=0.01)
    judge = LiteLLMJudge(config)
    conversation = [
        {"role": "user", "content": "Cancel it."},
        {"role": "assistant", "content": "Done."},
    ]
    assert await judge(conversation, ["a"]) == (False,)
    assert judge.usage.failed_calls == 1 and judge.usage.calls == 1
    assert "user: Cancel it." in server.requests[-1]["messages"][1]["content"]
    with pytest.raises(JudgeFormatError):
        await judge(conversation, ["a"])


def test_the_user_prompt_is_the_guidelines_and_the_scenario(tau2_data: Any) -> None:
    from turnrl.tool_envs.tau.tau2.llm import user_prompt

    template = user_prompt(tau2_data)
    text = template.format(instruction="Instructions:\n\tBuy a.")
    assert text.startswith("# User Simulation Guidelines")
    assert text.endswith("<scenario>\nInstructions:\n\tBuy a.\n</scenario>")
    assert "tool" in user_prompt(tau2_data, with_tools=True).lower()


class GoldUser(WalletUser):
    """Plays a task's gold user actions: each agent message asking for one is answered by
    that tool call, then by "done"; the last agent message is answered with ###STOP###."""

    def __init__(self) -> None:
        super().__init__([])
        self.pending: list[dict[str, Any]] = []

    async def reset(self, instruction: str) -> Any:
        return "Hello, I need help."

    async def respond(self, agent_message: str) -> Any:
        if self.pending:
            return {"role": "assistant", "content": None, "tool_calls": [self.pending.pop(0)]}
        return "Thanks. ###STOP###" if agent_message.startswith("Summary") else "OK."

    async def tool_results(self, messages: list[dict[str, Any]]) -> Any:
        self.results.append(messages)
        return "Done."


async def _replay_gold(env: Tau2Env, task: Tau2Task, user: GoldUser) -> None:
    await env.reset(task)
    for action, side in zip(task.gold_actions, task.gold_requestors, strict=True):
        call = _tc(action.name, dict(action.arguments))
        if side == "user":
            user.pending.append(call)
            await env.step({"role": "assistant", "content": f"Please run {action.name}."})
        else:
            await env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    summary = "Summary: " + " ".join(task.communicate_info)
    result = await env.step({"role": "assistant", "content": summary})
    assert result.done and result.info["done_reason"] == "user_stop", task.id


@pytest.mark.slow
@pytest.mark.parametrize("name", ["airline", "retail", "telecom"])
async def test_playing_the_gold_actions_through_an_episode_scores_one(
    tau2_data: Any, name: str
) -> None:
    """Every task of the ``base`` split (telecom: all 2,285), its gold actions played by the
    agent (and, in telecom, by the user through its own tools), scores 1 (NL verdicts given
    as met); doing nothing passes only tasks whose gold actions change nothing."""
    from turnrl.tool_envs.tau.tau2.domain import load_domain

    domain = load_domain(name, tau2_data / name)
    tasks = load_tasks(tau2_data / name, None if name == "telecom" else "base")  # telecom: all
    failing, idle_passes = [], 0
    for task in tasks:
        user = GoldUser()
        env = Tau2Env(domain, user)
        await _replay_gold(env, task, user)
        verdicts = (True,) * len(task.nl_assertions)
        reward = env.reward(verdicts)
        if reward.reward != 1.0:
            failing.append(
                (task.id, {k: v for k, v in reward.breakdown.items() if k.startswith("r_")})
            )
        # Doing nothing passes only a task whose gold actions change nothing.
        idle = Tau2Env(domain, GoldUser())
        await idle.reset(task)
        await idle.step({"role": "assistant", "content": "Summary: nothing"})
        if idle.reward(verdicts).reward == 1.0:
            idle_passes += 1
            agent, phone = domain.start(task)
            start = (agent.db_hash(), None if phone is None else phone.db_hash())
            says = "COMMUNICATE" in task.reward_basis and task.communicate_info
            assert idle.gold_hashes() == start and not says, task.id
    assert len(tasks) == {"airline": 50, "retail": 114, "telecom": 2285}[name]
    assert failing == [], failing
    assert idle_passes < len(tasks) / 2


class ToolCallingServer(ChatServer):
    """A model that first calls the ``pay`` tool when offered it, then says stop."""

    def __init__(self) -> None:
        super().__init__([])

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("tools") and not any(m["role"] == "tool" for m in body["messages"]):
            call = {"id": "u1", "type": "function", "function": {"name": "pay", "arguments": "{}"}}
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"role": "assistant", "content": "All paid. ###STOP###"}


@needs_litellm
async def test_the_llm_user_calls_its_own_tools(serve: Any) -> None:
    from turnrl.tool_envs.user_sim import LiteLLMUser, LiteLLMUserConfig

    server = ToolCallingServer()
    config = LiteLLMUserConfig(model="openai/user", api_base=await serve(server))
    user = LiteLLMUser(config)
    env = Tau2Env(_shop_domain(), user)
    opening = await env.reset(_task())
    assert [t["function"]["name"] for t in server.requests[0]["tools"]] == ["balance", "pay"]
    assert opening[-1] == {"role": "user", "content": "All paid. ###STOP###"}
    assert env.phone is not None and env.phone.state()["paid"] is True
    tool_message = server.requests[1]["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["content"] == "paid"
    assert env.tool_calls == [("pay", {})] and env.ending == "user_stop"


async def test_an_agent_tool_called_by_the_user_is_an_error_for_the_user_only() -> None:
    sell = {"role": "assistant", "content": None, "tool_calls": [_tc("sell", {"item": "a"})]}
    user = WalletUser(["hi", sell, "Hm. ###STOP###"])
    env = Tau2Env(_shop_domain(), user)
    await env.reset(_task())
    result = await env.step({"role": "assistant", "content": "Anything else?"})
    assert user.results[0][0]["content"] == "Error: Tool 'sell' not found."
    assert result.observations == [{"role": "user", "content": "Hm. ###STOP###"}]
    assert env.agent.state()["items"]["a"]["sold"] is False and env.errors == 1


def test_the_incremental_table_hash_equals_the_plain_one() -> None:
    from turnrl.tool_envs.tau.db import PristineData
    from turnrl.tool_envs.tau.tau2.toolkit import state_hash

    pristine = PristineData({"b": {"x": {"n": 1, "d": "é"}, "a": {"n": [2, 1]}}, "a": {}})
    db = pristine.new_database()
    assert db.json_hash() == state_hash(db.tables)
    db.mutable("b", "x")["n"] = 5.0
    assert db.json_hash() == state_hash(db.tables)
    db.put("a", "new", {"k": None})
    db.put("b", "0", {"z": True})
    assert db.json_hash() == state_hash(db.tables) != state_hash(pristine.tables)
