"""Checkpoints that resume exactly, and export to a Hugging Face folder.

A checkpoint folder holds

- `state/`: model and optimizer state through `torch.distributed.checkpoint` (each rank
  writes its shards; works unsharded in a single process too),
- `rng_rank<r>.pt`: this rank's torch CPU, accelerator and Python RNG states,
- `trainer_state.json`: step, world size, the caller's data position (`data_state`) and
  the sha256 of every other file (`sha256`), written last, so a folder without it is an
  incomplete checkpoint.

DCP stores raw tensor bytes without a checksum, so a flipped byte in a shard would load
as a silently wrong weight; the digests turn it into an error. Each rank hashes the
files it wrote at save, and a share of all files at load (~1.5 GB/s per rank).

`export_hf` gathers the full weights on rank 0 and writes `config.json`, a
`model.safetensors` and the tokenizer / generation files of the source folder, into a
temporary folder renamed into place, so an engine reloading it never sees half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from turnrl.grpo_core.training.policy import resolve_dtype

if TYPE_CHECKING:
    from turnrl.grpo_core.training.torch_engine import TorchEngine
    from turnrl.grpo_core.training.trainer import Trainer

TRAINER_STATE = "trainer_state.json"
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".safetensors.index.json",
    ".bin.index.json",
)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["device"])


def save_checkpoint(engine: Trainer, folder: Path, data_state: dict[str, Any]) -> Path:
    """Save the engine's full training state to `folder` (every rank must call this).

    Args:
        engine: the engine to save.
        folder: checkpoint folder (created; an existing checkpoint there is replaced).
        data_state: JSON-serialisable position of the caller's data (e.g. epoch, index).

    Returns:
        `folder`.
    """
    json.dumps(data_state)  # fail before writing anything if it is not serialisable
    if _rank() == 0:
        (folder / TRAINER_STATE).unlink(missing_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
    try:
        with warnings.catch_warnings():  # single process: DCP warns that it saves unsharded
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_keyed(engine, model_sd, optim_sd), checkpoint_id=str(folder / "state"))
        torch.save(_rng_state(engine.device), folder / f"rng_rank{_rank()}.pt")
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise _write_failure(folder, exc) from exc
    _barrier()
    digests = _gather_digests(folder)
    if _rank() == 0:
        meta = {
            "step": engine.step,
            "world_size": engine.dp_size,
            "model_parallel": _model_parallel(engine),
            "data_state": data_state,
            "sha256": digests,
        }
        # Written last and atomically: a folder with this file is a complete checkpoint.
        partial = folder / (TRAINER_STATE + ".tmp")
        partial.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        os.replace(partial, folder / TRAINER_STATE)
    _barrier()
    return folder


def _model_parallel(engine: Trainer) -> int:
    """How many ranks split one model copy (1 but for a model-parallel megatron engine)."""
    return engine.model_parallel_size


def _keyed(engine: Trainer, model_sd: Any, optim_sd: Any) -> dict[str, Any]:
    """The state DCP saves. A model-parallel shard is a plain tensor that differs between
    ranks under one name, which DCP would take for a replica and write once: each shard
    gets its own keys (``model@mp1``), written by its ranks (data-parallel copies once)."""
    tag = f"@mp{engine.model_parallel_rank}" if _model_parallel(engine) > 1 else ""
    return {f"model{tag}": model_sd, f"optim{tag}": optim_sd}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _gather_digests(folder: Path) -> dict[str, str]:
    """The sha256 of every file of the checkpoint, by path relative to `folder`: each rank
    hashes what it wrote (its DCP shards and RNG file; rank 0 also the DCP metadata)."""
    rank = _rank()
    mine = [*(folder / "state").glob(f"__{rank}_*"), folder / f"rng_rank{rank}.pt"]
    if rank == 0:
        mine.append(folder / "state" / ".metadata")
    digests = {str(p.relative_to(folder)): _sha256(p) for p in mine if p.is_file()}
    if dist.is_available() and dist.is_initialized():
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, digests)
        digests = {k: v for part in parts for k, v in part.items()}
    return dict(sorted(digests.items()))


class CorruptCheckpointError(ValueError):
    """A checkpoint file does not hold the bytes that were saved."""


def _verify_digests(folder: Path, digests: dict[str, str]) -> None:
    """Check the files against the digests saved with them (each rank a share), before
    anything is loaded; every rank raises if any rank found a bad file."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    bad = []
    for name, expected in list(digests.items())[rank::world]:
        path = folder / name
        if not path.is_file():
            bad.append(f"{name} is missing")
        elif _sha256(path) != expected:
            bad.append(f"{name} does not hold the bytes that were saved (sha256 mismatch)")
    if world > 1:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, bad)
        bad = [b for part in parts for b in part]
    if bad:
        raise CorruptCheckpointError(
            f"corrupt checkpoint {folder}: {'; '.join(bad)}; resume from an earlier one"
        )


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the folder is left incomplete, so never loaded)."""


def _write_failure(folder: Path, exc: BaseException) -> CheckpointWriteError:
    """Name the cause: a full file system says so (DCP's own message does not)."""
    try:
        stat = os.statvfs(folder)
        free = stat.f_bavail * stat.f_frsize
    except OSError:
        free = -1
    full = 0 <= free < (1 << 20) or "No space left" in repr(exc)
    why = f"no space left on its file system ({free} bytes free)" if full else repr(exc)
    return CheckpointWriteError(
        f"saving the checkpoint to {folder} failed: {why}; it is incomplete and is never "
        "loaded, earlier checkpoints are untouched"
    )


def load_checkpoint(engine: Trainer, folder: Path) -> dict[str, Any]:
    """Restore model, optimizer, RNG states and step saved by `save_checkpoint`.

    Args:
        engine: an engine built with the same model and world size.
        folder: the checkpoint folder.

    Returns:
        The `data_state` saved with the checkpoint.

    Raises:
        FileNotFoundError: the folder is not a complete checkpoint.
        CorruptCheckpointError: a file's bytes differ from those saved (nothing loaded).
        ValueError: it was saved with a different world size.
    """
    meta_path = folder / TRAINER_STATE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {TRAINER_STATE})")
    meta = json.loads(meta_path.read_text())
    saved = (meta["world_size"], meta.get("model_parallel", 1))
    this = (engine.dp_size, _model_parallel(engine))
    if saved != this:
        raise ValueError(
            f"checkpoint was saved with world size {saved[0]} and {saved[1]} model-parallel "
            f"shards, this run has world size {this[0]} and {this[1]}"
        )
    _verify_digests(folder, meta.get("sha256", {}))  # older checkpoints have none
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
    state = _keyed(engine, model_sd, optim_sd)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder / "state"))
    model_sd, optim_sd = state.values()
    set_state_dict(
        engine.module, engine.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    rng = torch.load(folder / f"rng_rank{_rank()}.pt", weights_only=False)
    _set_rng_state(rng, engine.device)
    engine.step = int(meta["step"])
    return dict(meta["data_state"])


def export_hf(engine: TorchEngine, folder: Path, dtype: str = "float32") -> Path:
    """Write the engine's weights as a Hugging Face model folder (every rank must call this).

    Args:
        engine: the engine whose weights to export.
        folder: output folder; replaced atomically if it exists.
        dtype: `float32` or `bfloat16` for the saved tensors.

    Returns:
        `folder`, loadable by `AutoModelForCausalLM.from_pretrained` and by vLLM.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full: dict[str, Any] = get_model_state_dict(engine.module, options=options)
    if _rank() == 0:
        prefix = "model."  # the CausalLMLogProbs wrapper's attribute
        weights = {k.removeprefix(prefix): v for k, v in full.items()}
        write_hf_folder(
            weights, engine.hf_model.config, Path(engine.config.model_path), folder, dtype
        )
    _barrier()
    return folder


def write_hf_folder(
    weights: dict[str, torch.Tensor], config: Any, source: Path, folder: Path, dtype: str
) -> Path:
    """Write Hugging Face-named ``weights`` with ``config`` (a transformers config) and the
    tokenizer / chat-template files of ``source`` as the model folder ``folder``, replacing
    it atomically; the tied output embedding is left out when the config ties it."""
    from safetensors.torch import save_file

    torch_dtype = resolve_dtype(dtype)
    weights = {k: v.detach().to(torch_dtype).contiguous() for k, v in weights.items()}
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _copy_side_files(source, tmp)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["dtype"] = config_dict["torch_dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    _replace_folder(tmp, folder)
    return folder


def _copy_side_files(source: Path, dest: Path) -> None:
    """Copy tokenizer, chat template and generation files (not weights or config)."""
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if (
            path.is_file()
            and path.name != "config.json"
            and not path.name.endswith(_WEIGHT_SUFFIXES)
        ):
            shutil.copy2(path, dest / path.name)


def _replace_folder(tmp: Path, folder: Path) -> None:
    """Move `tmp` to `folder`, replacing an existing folder."""
    old = folder.parent / f".{folder.name}.old-{os.getpid()}"
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
