"""The torch training engine on a tiny real Qwen3 model (CPU, single process)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.grpo_core.algos import AGGREGATION_MODES, ActorLossConfig
from turnrl.grpo_core.loop.loop import token_budget_micro_batches
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.reference import ReferencePolicy
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import (
    OptimizerConfig,
    TorchEngine,
    TorchEngineConfig,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def make_batch(seed: int = 0, rows: int = 4, length: int = 24) -> TrainBatch:
    """Random token rows of uneven lengths; the last 2/3 of each row is the response."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 700, (rows, length), generator=g)
    attn = torch.ones_like(ids)
    for row in range(rows):
        attn[row, length - 3 * row :] = 0 if row else 1
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, length // 3 :] = 1
    loss_mask *= attn
    adv = torch.linspace(1.0, -1.0, rows)
    return TrainBatch(ids, attn, loss_mask, advantages=adv)


def engine_for(tiny: Path, **kwargs: object) -> TorchEngine:
    defaults: dict[str, object] = {"optimizer": OptimizerConfig(lr=1e-3), "micro_batch_size": 4}
    defaults.update(kwargs)
    return TorchEngine(TorchEngineConfig(model_path=str(tiny), **defaults))  # type: ignore[arg-type]


def params(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.hf_model.named_parameters()}


def grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    """The gradients of the last step (zeroed only at the start of the next one)."""
    return {k: v.grad.clone() for k, v in engine.hf_model.named_parameters() if v.grad is not None}


def assert_grads_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        # fp32 rounding of reordered sums: ~3e-8 absolute where gradients reach 5e-2.
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-7)


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, worst


def naive_logprobs(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Reference: full logits, log-softmax, gather; zero outside the loss mask (on the CPU,
    from a model on any device)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits.cpu()
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    picked = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros(picked.shape[0], 1), picked], dim=1)
    return out * batch.loss_mask


def test_compute_logprobs_matches_full_logits(tiny: Path) -> None:
    engine = engine_for(tiny, micro_batch_size=3)
    batch = make_batch()
    got = engine.compute_logprobs(batch)
    expected = naive_logprobs(engine.hf_model, batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got[batch.loss_mask == 0] == 0).all()


def test_sft_loss_decreases_on_memorisable_batch(tiny: Path) -> None:
    engine = engine_for(tiny, optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0))
    batch = make_batch(seed=1)
    losses = [engine.train_step(batch, objective="sft")["loss"] for _ in range(15)]
    # Random init: NLL ~ ln(2048) = 7.6. Fifteen AdamW steps on one batch must at least halve it.
    assert losses[0] == pytest.approx(7.6, abs=0.3)
    assert losses[-1] < 0.5 * losses[0], losses


def test_rl_steps_move_logprobs_along_the_advantage_sign(tiny: Path) -> None:
    engine = engine_for(tiny, loss=ActorLossConfig(eps_clip=0.2, eps_clip_high=0.28))
    batch = make_batch(seed=2)
    batch = replace(batch, advantages=torch.tensor([1.0, 1.0, -1.0, -1.0]))
    before = engine.compute_logprobs(batch)
    old = before.clone()
    for _ in range(4):
        metrics = engine.train_step(replace(batch, old_logprobs=old))
    after = engine.compute_logprobs(batch)
    seq_gain = ((after - before) * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1)
    assert (seq_gain[:2] > 0.05).all() and (seq_gain[2:] < -0.05).all(), seq_gain
    # Off-policy steps after the first clip some tokens and report it.
    assert 0 < metrics["clip_frac"] <= 1
    assert metrics["approx_kl"] != 0


def test_gradient_accumulation_equals_one_big_batch(tiny: Path) -> None:
    batch = make_batch(seed=3)
    whole = engine_for(tiny, micro_batch_size=4, loss=ActorLossConfig(entropy_coef=0.01))
    split = engine_for(tiny, micro_batch_size=1, loss=ActorLossConfig(entropy_coef=0.01))
    m_whole = whole.train_step(batch)
    m_split = split.train_step(batch)
    assert m_split["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5)
    assert m_split["pg_loss"] == pytest.approx(m_whole["pg_loss"], abs=1e-6)
    assert m_split["entropy"] == pytest.approx(m_whole["entropy"], rel=1e-5)
    # Compare gradients, not parameters: Adam's first step, lr * g / (|g| + eps), turns
    # float rounding in near-zero gradients into visible parameter differences.
    assert_grads_close(grads(whole), grads(split))
    # Explicit (uneven) micro-batches, as token-budget packing produces, give the same step.
    packed = engine_for(tiny, loss=ActorLossConfig(entropy_coef=0.01))
    packed.train_step([batch.select(slice(0, 1)), batch.select(slice(1, 4))])
    assert_grads_close(grads(whole), grads(packed))


def test_gradient_checkpointing_gives_the_same_step(tiny: Path) -> None:
    batch = make_batch(seed=4)
    plain = engine_for(tiny)
    ckpt = engine_for(tiny, gradient_checkpointing=True)
    flag = "is_activation_checkpointing"  # transformers 5 name; 4.x has is_gradient_checkpointing
    if not hasattr(ckpt.hf_model, flag):
        flag = "is_gradient_checkpointing"
    assert getattr(ckpt.hf_model, flag) and not getattr(plain.hf_model, flag)
    assert plain.train_step(batch)["loss"] == pytest.approx(
        ckpt.train_step(batch)["loss"], abs=1e-7
    )
    assert_grads_close(grads(plain), grads(ckpt))


def test_bf16_autocast_step_tracks_fp32(tiny: Path) -> None:
    batch = make_batch(seed=5)
    fp32 = engine_for(tiny).train_step(batch, objective="sft")
    bf16_engine = engine_for(tiny, dtype="bfloat16")
    bf16 = bf16_engine.train_step(batch, objective="sft")
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2)
    assert next(bf16_engine.hf_model.parameters()).dtype == torch.float32  # master weights


def test_gradient_clipping_bounds_the_update(tiny: Path) -> None:
    batch = make_batch(seed=6)
    opt = OptimizerConfig(lr=1e-3, clip_grad=1e-3, weight_decay=0.0)
    engine = engine_for(tiny, optimizer=opt)
    metrics = engine.train_step(batch, objective="sft")
    assert metrics["grad_norm"] > 1e-3  # the reported norm is the one before clipping
    grads = [p.grad for p in engine.hf_model.parameters() if p.grad is not None]
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)


def test_lr_warmup_rises_linearly_then_leaves_the_lr_to_the_caller(tiny: Path) -> None:
    engine = engine_for(tiny, optimizer=OptimizerConfig(lr=1e-3, lr_warmup_steps=4))
    batch = make_batch(seed=7)
    lrs = [engine.train_step(batch, objective="sft")["lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    for group in engine.optimizer.param_groups:  # a caller's schedule after the warm-up
        group["lr"] = 1e-5
    assert engine.train_step(batch, objective="sft")["lr"] == pytest.approx(1e-5)
    plain = engine_for(tiny)  # no warm-up: the lr is never touched
    plain.optimizer.param_groups[0]["lr"] = 2e-5
    assert plain.train_step(batch, objective="sft")["lr"] == pytest.approx(2e-5)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_packing_filler_micro_batch_leaves_the_step_unchanged(tiny: Path, mode: str) -> None:
    """Rows of 24, 21, 18, 15 and 12 tokens under a budget of 26 for 2 ranks: no two fit
    together, so 5 micro-batches round up to 6 and one is empty. The loop's filler row in its
    place (its rank's run of 3 micro-batches) gives the loss and gradient of the batch in one
    piece, in every aggregation mode: it adds no loss, no token and no sequence."""
    batch = make_batch(seed=4, rows=5)
    micro, plan = token_budget_micro_batches(batch, 26, dp_size=2)
    assert [len(mb) for rank in plan.micro_batches for mb in rank].count(0) == 1
    assert len(micro) == 6 and sum(mb.num_sequences for mb in micro) == 6
    loss = ActorLossConfig(loss_agg_mode=mode, norm_length=24.0, entropy_coef=0.01)  # type: ignore[arg-type]
    whole, packed = engine_for(tiny, loss=loss, micro_batch_size=5), engine_for(tiny, loss=loss)
    m_whole, m_packed = whole.train_step(batch), packed.train_step(micro)
    for key in ("loss", "pg_loss", "entropy", "num_tokens"):
        assert m_packed[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key
    assert_grads_close(grads(whole), grads(packed))


def test_checkpoint_resume_gives_identical_next_step(tiny: Path, tmp_path: Path) -> None:
    batches = [make_batch(seed=10 + i) for i in range(4)]
    straight = engine_for(tiny, loss=ActorLossConfig(entropy_coef=0.01))
    straight_losses = [straight.train_step(b)["loss"] for b in batches[:3]]
    after_straight = torch.rand(4)

    first = engine_for(tiny, loss=ActorLossConfig(entropy_coef=0.01))
    for b in batches[:2]:
        first.train_step(b)
    first.save_checkpoint(tmp_path / "ckpt", data_state={"next_batch": 2})
    del first
    torch.manual_seed(999)  # a fresh process's RNG differs; the checkpoint restores it
    resumed = engine_for(tiny, loss=ActorLossConfig(entropy_coef=0.01))
    data_state = resumed.load_checkpoint(tmp_path / "ckpt")
    assert data_state == {"next_batch": 2}
    assert resumed.step == 2
    loss = resumed.train_step(batches[data_state["next_batch"]])["loss"]
    assert loss == straight_losses[2]
    assert torch.equal(torch.rand(4), after_straight)
    assert_params_close(params(straight), params(resumed), atol=0.0)
    # Optimizer moments were restored too: the step after that still agrees exactly.
    assert resumed.train_step(batches[3])["loss"] == straight.train_step(batches[3])["loss"]


def test_checkpoint_errors(tiny: Path, tmp_path: Path) -> None:
    engine = engine_for(tiny)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        engine.load_checkpoint(tmp_path / "missing")
    with pytest.raises(TypeError):
        engine.save_checkpoint(tmp_path / "bad", data_state={"x": object()})
    engine.save_checkpoint(tmp_path / "ok", data_state={})
    meta = json.loads((tmp_path / "ok" / "trainer_state.json").read_text())
    meta["world_size"] = 8
    (tmp_path / "ok" / "trainer_state.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="world size 8"):
        engine.load_checkpoint(tmp_path / "ok")


@pytest.mark.parametrize("tie", [False, True])
def test_export_reloads_to_identical_logits(tmp_path: Path, tie: bool) -> None:
    from turnrl.grpo_core.training.tiny_model import TinyModelConfig

    src = build_tiny_model(tmp_path / "src", TinyModelConfig(tie_word_embeddings=tie))
    engine = engine_for(src)
    engine.train_step(make_batch(seed=7), objective="sft")
    out = engine.export_hf(tmp_path / "export")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    # Both models on the trainer's device: the same kernels, so the logits are equal bit for bit.
    reloaded = AutoModelForCausalLM.from_pretrained(out).to(engine.device)
    ids = make_batch(seed=8).input_ids.to(engine.device)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, engine.hf_model(ids).logits)
    # Exporting again replaces the folder atomically with the newer weights.
    engine.train_step(make_batch(seed=9), objective="sft")
    engine.export_hf(out)
    again = AutoModelForCausalLM.from_pretrained(out).to(engine.device)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, engine.hf_model(ids).logits)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]


def test_export_bf16_halves_the_file(tiny: Path, tmp_path: Path) -> None:
    engine = engine_for(tiny)
    fp32 = engine.export_hf(tmp_path / "fp32")
    bf16 = engine.export_hf(tmp_path / "bf16", dtype="bfloat16")
    size32 = (fp32 / "model.safetensors").stat().st_size
    size16 = (bf16 / "model.safetensors").stat().st_size
    assert size16 == pytest.approx(size32 / 2, rel=0.01)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(bf16)
    assert model.dtype == torch.bfloat16


def test_reference_logprobs_and_kl_loss(tiny: Path) -> None:
    ref = ReferencePolicy(tiny, micro_batch_size=2)
    batch = make_batch(seed=11)
    ref_logp = ref.compute_logprobs(batch)
    torch.testing.assert_close(
        ref_logp, naive_logprobs(ref.module.model, batch), atol=1e-5, rtol=1e-5
    )
    loss = ActorLossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    engine = engine_for(tiny, loss=loss)
    batch = ref.attach(batch)
    first = engine.train_step(batch)
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-9)  # policy == reference at step 0
    second = engine.train_step(batch)
    assert second["kl_loss"] > 1e-6
    # The reference stays frozen while the policy moves.
    torch.testing.assert_close(ref.compute_logprobs(batch), ref_logp, atol=0, rtol=0)


def test_temperature_scales_logits(tiny: Path) -> None:
    batch = make_batch(seed=12)
    hot = engine_for(tiny, temperature=2.0).compute_logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 2.0
    expected = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None])
    expected = torch.cat([torch.zeros(4, 1), expected.squeeze(-1)], 1) * batch.loss_mask
    torch.testing.assert_close(hot, expected, atol=1e-5, rtol=1e-5)


def test_train_step_input_errors(tiny: Path) -> None:
    engine = engine_for(tiny)
    batch = make_batch()
    with pytest.raises(ValueError, match="advantages"):
        engine.train_step(replace(batch, advantages=None))
    with pytest.raises(ValueError, match="objective"):
        engine.train_step(batch, objective="dpo")
    with pytest.raises(ValueError, match="no micro-batches"):
        engine.train_step([])
    with pytest.raises(ValueError, match="no loss tokens"):
        engine.train_step(replace(batch, loss_mask=torch.zeros_like(batch.loss_mask)))
    kl_engine = engine_for(tiny, loss=ActorLossConfig(use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_engine.train_step(batch)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"logprob_chunk_size": 0}, "logprob_chunk_size"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_bad_engine_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TorchEngineConfig(model_path="unused", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr"),
        ({"adam_beta2": 1.0}, "betas"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"lr_warmup_steps": -1}, "lr_warmup_steps"),
        ({"adam_eps": 0.0}, "adam_eps"),
    ],
)
def test_bad_optimizer_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kl_loss_type": "k9"}, "kl_loss_type"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
        ({"policy_loss": "trpo"}, "policy_loss"),
        ({"entropy_coef": -0.1}, ">= 0"),
    ],
)
def test_bad_loss_config_is_rejected_by_the_engine_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TorchEngineConfig(model_path="unused", loss=ActorLossConfig(**kwargs))


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        TorchEngine(TorchEngineConfig(model_path=str(tmp_path)))


def test_memory_margin_is_refused_on_the_cpu_and_checked_with_mocked_gpu_memory(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a margin stops the step (nothing to keep free). The device check is shown
    with a MOCKED GPU: the engine's device set to cuda and ``torch.cuda.mem_get_info``
    patched (no GPU here); below the margin the step stops before touching the model."""
    engine = engine_for(tiny, memory_margin_bytes=1024)
    with pytest.raises(ValueError, match="--train-memory-margin-bytes 1024: the CPU"):
        engine.train_step(make_batch())
    assert engine.step == 0
    monkeypatch.setattr(engine.steps, "device", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (512, 4096))
    with pytest.raises(MemoryError, match="only 512 bytes of cuda:0 are free"):
        engine.train_step(make_batch())
    assert engine.step == 0
    with pytest.raises(ValueError, match="memory_margin_bytes must be >= 0"):
        TorchEngineConfig(model_path=str(tiny), memory_margin_bytes=-1)


def test_weight_decay_reaches_the_matrices_only(tiny: Path) -> None:
    """As Megatron's ``get_param_groups``: with zero gradients (zero advantages) AdamW's step
    is its decay alone, which scales every matrix by 1 - lr x wd and leaves the norms'
    weights (1-D) as they were; a bias is not decayed either."""
    engine = engine_for(tiny, optimizer=OptimizerConfig(lr=0.1, weight_decay=0.5))
    before = params(engine)
    batch = make_batch(seed=3)
    engine.train_step(replace(batch, advantages=torch.zeros_like(batch.advantages)))
    after = params(engine)
    norms = [name for name in before if before[name].ndim == 1]
    assert norms and len(norms) < len(before)
    for name, value in before.items():
        expected = value if value.ndim == 1 else value * (1 - 0.1 * 0.5)
        torch.testing.assert_close(after[name], expected, rtol=1e-6, atol=0, msg=name)
    from turnrl.grpo_core.training.torch_engine import make_optimizer

    layer = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    layer[1].bias.data = layer[1].bias.data[:, None]  # a bias that is not 1-D
    groups = make_optimizer(layer, OptimizerConfig(weight_decay=0.1)).param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(layer[0].weight), id(layer[1].weight)}
