"""ReTool episodes end to end with the real sandbox, chat template and reward.

The policy here is a scripted stand-in for the vLLM engine (whose real run is the
`@pytest.mark.vllm` smoke test): it answers token-in/token-out like an engine, with a tool
call that computes the problem, then the `\\boxed{}` answer (or a wrong one).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from turnrl_app_retool.config import preset
from turnrl_app_retool.episodes import episode_settings, validation_record

from turnrl.grpo_core.training.tiny_model import IM_END, build_tiny_tokenizer
from turnrl.npu_runtime.net import free_port
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Generation, SamplingParams
from turnrl.tool_envs.retool.episodes import generations_text, per_problem_accuracy, run_tasks
from turnrl.tool_envs.retool.synth import make_problems
from turnrl.tool_envs.sandbox import SandboxClient, SandboxClientConfig
from turnrl.tool_envs.sandbox.embedded import TEST_SERVER_ARGS, EmbeddedSandbox


class ScriptedPolicy:
    """Engine stand-in: calls code_interpreter once, then boxes the tool output (or ``wrong``)."""

    def __init__(self, chat: ChatTokenizer, use_tool: bool = True, wrong: bool = False) -> None:
        self.chat, self.use_tool, self.wrong = chat, use_tool, wrong
        self.calls = 0

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        self.calls += 1
        text = self.chat.decode(prompt_ids)
        outputs = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
        if self.use_tool and not outputs:
            user = text[text.rindex("<|im_start|>user") :]
            expression = " ".join(re.findall(r"\d+", user)[:2]).replace(" ", " * ")
            reply = (
                'Let me compute.\n<tool_call>\n{"name": "code_interpreter", "arguments": '
                f'{{"code": "print({expression})"}}}}\n</tool_call>'
            )
        else:
            answer = "0" if self.wrong or not outputs else outputs[-1].strip()
            reply = f"The result is \\boxed{{{answer}}}."
        ids = [*self.chat.encode(reply), self.chat.end_of_turn_id]
        return Generation(ids, [-0.5] * len(ids), "stop", self.chat.end_of_turn_id)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    folder = Path(tmp_path_factory.mktemp("tok"))
    build_tiny_tokenizer().save_pretrained(folder)
    chat = ChatTokenizer.from_dir(folder)
    assert chat.end_of_turn == IM_END
    return chat


@pytest.fixture(scope="module")
def sandbox_client():
    with EmbeddedSandbox(*TEST_SERVER_ARGS) as sandbox:
        yield SandboxClient(SandboxClientConfig(url=sandbox.url))


def tasks(num: int):
    # Plain products only ("What is a * b?"), the kind the scripted policy can compute.
    problems = [p for p in make_problems(200, seed=2) if p.problem.startswith("What is")]
    return [p.task(i) for i, p in enumerate(problems[:num])]


async def test_tool_using_policy_is_correct_and_rewarded(chat, sandbox_client) -> None:
    config = preset("smoke")
    settings = episode_settings(config, chat, sandbox_client, temperature=1.0, top_p=1.0)
    items = tasks(3)
    trajs = await run_tasks(ScriptedPolicy(chat), settings, items, n=2)
    assert len(trajs) == 6
    assert [t.group_id for t in trajs] == ["g-0", "g-0", "g-1", "g-1", "g-2", "g-2"]
    for t in trajs:
        assert t.status == "completed", t.metadata
        assert t.num_tool_calls == 1 and t.num_turns == 2
        assert t.metadata["num_turns_verl"] == 4
        assert t.reward == 1.0 and t.reward_breakdown["correct"] == 1.0
        # the interpreter output is in the trajectory, with loss mask 0
        tool_ids = chat.encode(t.metadata["answer"])
        text = chat.decode(t.response_ids)
        assert f"<tool_response>\n{t.metadata['answer']}\n</tool_response>" in text
        assert sum(t.loss_mask) < len(t.response_ids) and tool_ids
    record = validation_record({"synth_arith": trajs}, 1.0)
    assert record["datasets"]["synth_arith"]["score"] == 1.0 and record["trials"] == 2
    assert record["metrics"]["num_turns"] == 2.0 and record["metrics"]["reward"] == 1.0
    assert record["metrics"]["pass^2"] == 1.0
    assert "\\boxed{" in generations_text(trajs, chat, limit=1)


async def test_wrong_answers_get_the_tool_bonus_only_with_tools(chat, sandbox_client) -> None:
    settings = episode_settings(preset("smoke"), chat, sandbox_client, 1.0, 1.0)
    items = tasks(2)
    with_tool = await run_tasks(ScriptedPolicy(chat, wrong=True), settings, items, n=1)
    no_tool = await run_tasks(ScriptedPolicy(chat, use_tool=False, wrong=True), settings, items, 1)
    assert [t.reward for t in with_tool] == [-0.9, -0.9]  # -1 + 0.1 x 1 round
    assert [t.reward for t in no_tool] == [-1.0, -1.0]
    assert validation_record({"x": no_tool}, 1.0)["metrics"]["num_turns"] == 1.0
    assert validation_record({"x": with_tool}, 1.0)["score"] == 0.0


def test_a_validation_record_needs_episodes() -> None:
    with pytest.raises(ValueError, match="no episodes"):
        validation_record({"x": []}, 1.0)


async def test_a_sandbox_outage_is_counted_not_scored(chat, sandbox_client) -> None:
    """Episodes whose sandbox was down are failed: out of every mean, counted, named."""
    settings = episode_settings(preset("smoke"), chat, sandbox_client, 1.0, 1.0)
    good = await run_tasks(ScriptedPolicy(chat), settings, tasks(2), n=1)
    dead = SandboxClient(SandboxClientConfig(url=f"http://127.0.0.1:{free_port()}", max_retries=0))
    down = episode_settings(preset("smoke"), chat, dead, 1.0, 1.0)
    lost = await run_tasks(ScriptedPolicy(chat), down, tasks(2), n=1, group_prefix="d")
    assert [t.status for t in lost] == ["failed", "failed"]
    assert lost[0].metadata["error"].startswith("SandboxUnavailableError")
    record = validation_record({"x": good + lost}, 1.0)
    assert record["score"] == 1.0  # the outage did not count as wrong
    assert record["failed"] == 0.5 and record["per_item"]["x"] == [1.0, 1.0, None, None]
    assert record["error"].startswith("SandboxUnavailableError")
    with pytest.raises(RuntimeError, match=r"every held-out episode failed, e\.g\. SandboxUnav"):
        validation_record({"x": lost}, 1.0)


async def test_tool_schema_in_prompt_is_a_setting(chat, sandbox_client) -> None:
    for shown in (True, False):
        config = preset("smoke")
        config.data.tool_schema_in_prompt = shown
        settings = episode_settings(config, chat, sandbox_client, 1.0, 1.0)
        (traj,) = await run_tasks(ScriptedPolicy(chat), settings, tasks(1), n=1)
        assert ("<tools>" in chat.decode(traj.prompt_ids)) == shown
        assert traj.num_tool_calls == 1 and traj.reward == 1.0  # the tool runs either way


async def test_per_problem_accuracy_and_its_standard_error(chat, sandbox_client) -> None:
    settings = episode_settings(preset("smoke"), chat, sandbox_client, 1.0, 1.0)
    right = await run_tasks(ScriptedPolicy(chat), settings, tasks(2), n=2, group_prefix="a")
    wrong = await run_tasks(
        ScriptedPolicy(chat, wrong=True), settings, tasks(2), n=2, group_prefix="b"
    )
    trajs = [right[0], wrong[0], right[2], right[3], wrong[2], wrong[3]]
    trajs[1].group_id = "a-0"  # problem a-0: one right, one wrong
    assert per_problem_accuracy(trajs) == [0.5, 1.0, 0.0]
    record = validation_record({"x": trajs}, 1.0)
    assert record["score"] == pytest.approx(0.5) and record["per_item"]["x"] == [0.5, 1.0, 0.0]
    assert record["score_se"] == pytest.approx(0.5 / 3**0.5)  # std 0.5 over 3 problems


class _Samples:
    """The run logger's ``log_samples``, kept in memory."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def log_samples(self, step: int, texts: list[str], tag: str = "") -> None:
        self.texts += texts


async def test_the_apps_sandbox_killed_is_started_again_and_nothing_is_scored_for_it(
    chat: ChatTokenizer, tmp_path: Path
) -> None:
    """App level: the embedded sandbox of ``RetoolStages.serving`` is SIGKILLed (the scripted
    policy stands in for the engine). The next validation does not hang and scores no episode
    wrong for the outage (those it lost are ``failed``, the rest score as before); the app's
    sandbox is started again on its URL, and the validation after is whole again."""
    import asyncio
    import os
    import signal

    from turnrl_app_retool.data import Datasets
    from turnrl_app_retool.stages import RetoolStages

    from turnrl.npu_runtime.supervise import cmdline, descendants
    from turnrl.tool_envs.retool.env import DEFAULT_INSTRUCTION
    from turnrl.tool_envs.sandbox.embedded import can_contain

    config = preset("smoke")
    config.sandbox.insecure = not can_contain()
    build_tiny_tokenizer().save_pretrained(tmp_path)
    stages = RetoolStages(config, Datasets(config, DEFAULT_INSTRUCTION), _Samples())
    async with stages.serving(tmp_path, [], ScriptedPolicy(chat)) as serving:
        before = await serving.evaluate(0)
        assert before["failed"] == 0.0 and before["score"] > 0
        port = serving.settings.sandbox.config.url.rsplit(":", 1)[1]

        def servers() -> list[int]:  # the app's sandbox, not the other tests'
            return [
                p for p in descendants() if f"serve --host 127.0.0.1 --port {port}" in cmdline(p)
            ]

        (server,) = servers()
        os.killpg(server, signal.SIGKILL)
        during = await asyncio.wait_for(serving.evaluate(1), 120)
        for name, items in during["per_item"].items():
            kept = [
                (a, b)
                for a, b in zip(items, before["per_item"][name], strict=True)
                if a is not None
            ]
            assert all(a == b for a, b in kept), "an outage was scored as a wrong answer"
        if during["failed"]:
            assert "Sandbox" in during["error"]
        deadline = asyncio.get_running_loop().time() + 60
        while not servers():
            assert asyncio.get_running_loop().time() < deadline, "the sandbox was not restarted"
            await asyncio.sleep(0.2)
        after = await serving.evaluate(2)
        assert after["failed"] == 0.0 and after["per_item"] == before["per_item"]
    assert not servers()
