"""turnrl's HF <-> Megatron converter against mbridge's, bit for bit (slime's bridge mode).

slime's ``--megatron-to-hf-mode bridge`` converts weights with a Megatron bridge library.
``mbridge`` installs beside the pinned megatron-core (``Megatron-Bridge`` needs Transformer
Engine and CUDA builds, so not here); the ``megatron`` extra pulls it in. For the tiny
Qwen3 (q/k norms, untied output) and Qwen2 (q/k/v bias, tied embeddings) models, every
Megatron weight turnrl's ``hf_to_megatron`` makes in the Transformer Engine layout (the
names mbridge uses) must equal what mbridge's bridge makes from the same Hugging Face
weights, and mbridge's conversion of each back to Hugging Face names must give the original
tensors. Needs the ``megatron`` extra (nox session ``megatron``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: uv sync --extra megatron")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mbridge = pytest.importorskip("mbridge", reason="needs mbridge: uv sync --extra megatron")

from test_megatron_cpu import hf_model

from turnrl.grpo_core.megatron import hf_to_megatron, megatron_to_hf
from turnrl.grpo_core.megatron.parallel import model_parallel

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_turnrl_conversion_equals_mbridge_bit_for_bit(kind: str) -> None:
    model, arch = hf_model(kind)
    hf = model.state_dict()
    ours = hf_to_megatron(hf, arch, "te")
    assert sum(name.endswith("layer_norm_weight") for name in ours) == 2 * arch.num_layers
    with model_parallel(device="cpu"):
        bridge = mbridge.AutoBridge.from_config(model.config, dtype=torch.float32)
        for name, value in ours.items():
            hf_names = bridge._weight_name_mapping_mcore_to_hf(name)
            theirs = bridge._weight_to_mcore_format(name, [hf[n] for n in hf_names])
            assert torch.equal(theirs, value), name
            back_names, back = bridge._weight_to_hf_format(name, value)
            for hf_name, tensor in zip(back_names, back, strict=True):
                assert torch.equal(tensor, hf[hf_name]), (name, hf_name)
    # and turnrl's own way back is exact too (tied lm_head left out where tied)
    again = megatron_to_hf(ours, arch, "te")
    assert all(torch.equal(again[n], hf[n]) for n in again)
