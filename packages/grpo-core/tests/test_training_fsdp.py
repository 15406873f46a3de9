"""FSDP2 over gloo with 2 CPU processes (torchrun) matches one process on the whole batch."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig
from turnrl.npu_runtime.supervise import run_group

# Each rank trains on its half of the batch (rank 1's half is shorter, so it packs into fewer
# micro-batches and the engine must pad its micro-batch count). Then: checkpoint, one more
# step, restore the checkpoint, the same step again, and an HF export.
WORKER = """
import json, sys, torch, torch.distributed as dist
torch._C._set_print_stack_traces_on_fatal_signal(True)  # a native abort shows its C++ stack
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig

model, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
try:
    rank = dist.get_rank()
    batch = TrainBatch(**torch.load(f"{out}/batch.pt"))
    mine = [batch.select(slice(0, 3)), batch.select(slice(3, 4))][rank]
    engine = TorchEngine(TorchEngineConfig(
        model_path=model, optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=1))
    losses = [engine.train_step(mine, objective="sft")["loss"] for _ in range(2)]
    engine.save_checkpoint(f"{out}/ckpt", data_state={"rank0_saw": 3})
    losses.append(engine.train_step(mine, objective="sft")["loss"])
    state = engine.load_checkpoint(f"{out}/ckpt")
    again = engine.train_step(mine, objective="sft")["loss"]
    logp = engine.compute_logprobs(mine)
    engine.export_hf(f"{out}/export")
    engine.load_checkpoint(f"{out}/ckpt")
    if rank == 0:
        json.dump({"losses": losses, "again": again, "state": state,
                   "logp": logp.tolist()}, open(f"{out}/result.json", "w"))
finally:
    dist.destroy_process_group()
"""


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 700, (4, 20), generator=g)
    attn = torch.ones_like(ids)
    attn[3, 12:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask * attn}


@pytest.mark.slow
def test_fsdp2_two_cpu_ranks_match_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURNRL_DEVICE", "cpu")  # the one-process reference on the CPU too
    model = build_tiny_model(tmp_path / "tiny")
    out = tmp_path / "run"
    out.mkdir()
    torch.save(make_batch(), out / "batch.pt")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", TURNRL_DEVICE="cpu")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        str(model),
        str(out),
    ]
    code, output = run_group(cmd, timeout=240, env=env)
    if code != 0 and "(exitcode: -6)" in output:
        # Once in ~40 CI runs a rank died of a native abort inside torch / gloo ("terminate
        # called without an active exception" after loading weights), never reproduced
        # here; that launch is tried once more, afresh. Any other failure fails at once.
        print(output[-4000:])
        code, output = run_group(cmd, timeout=240, env=env)
    assert code == 0, output[-4000:]
    result = json.loads((out / "result.json").read_text())

    from turnrl.grpo_core.training.batch import TrainBatch

    batch = TrainBatch(**make_batch())
    single = TorchEngine(
        TorchEngineConfig(
            model_path=str(model), optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=4
        )
    )
    expected = [single.train_step(batch, objective="sft")["loss"] for _ in range(3)]
    # The sharded step is the same optimisation as one process on the whole batch.
    assert result["losses"] == pytest.approx(expected, abs=1e-5)
    # Resuming from the checkpoint replays step 3 exactly.
    assert result["again"] == result["losses"][2]
    assert result["state"] == {"rank0_saw": 3}
    # The export holds the full (unsharded) weights after step 3.
    exported = AutoModelForCausalLM.from_pretrained(out / "export")
    ids = batch.input_ids
    with torch.no_grad():
        torch.testing.assert_close(
            exported(ids).logits, single.hf_model(ids).logits, atol=1e-5, rtol=1e-4
        )
    # Sharded log-probs of rank 0's rows equal the single process's.
    logp = torch.tensor(result["logp"])
    torch.testing.assert_close(
        logp, single.compute_logprobs(batch.select(slice(0, 3))), atol=1e-5, rtol=1e-4
    )
