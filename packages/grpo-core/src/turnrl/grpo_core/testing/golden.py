"""A seeded reference GRPO run on a toy task: the golden loss curve and resume checks.

Task: each prompt is three token ids; the policy writes ``response_len`` tokens chosen
among the eight candidate ids 100-107 (constrained decoding) and earns the fraction of
even ids as reward. The policy that samples is the trainer's own model (on-policy, no
engine, no weight sync), and sampling draws from a ``torch.Generator`` seeded from
``(seed, loop step, prompt)``, so a run is a pure function of the seed and the weights:
a resumed run samples exactly what an uninterrupted one does.

The golden curve (torchtitan-style, one file per device kind) keeps the per-step
``train/loss``, ``rollout/reward_mean`` and ``train/grad_norm`` of a short run made with
deterministic algorithms and one thread; ``tests/test_loop_golden.py`` reruns it and
compares within :data:`RTOL` / :data:`ATOL`. Update the file after an intended change::

    python -m turnrl.grpo_core.testing.golden            # run and compare with the golden file
    python -m turnrl.grpo_core.testing.golden --update   # rewrite tests/golden/loop_<device>.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.backends import make_engine
from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.loop.loop import GRPOLoop, MetricsFn
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngineConfig

CANDIDATES = tuple(range(100, 108))
"""Token ids the toy policy chooses among; even ones earn reward."""
GOLDEN_METRICS = ("train/loss", "rollout/reward_mean", "train/grad_norm")
"""Per-step metrics kept in the golden file."""
RTOL = 1e-4
"""Relative tolerance of the golden comparison on the kind of CPU that wrote the file
(``cpu`` in the record). The run is sized so that this holds against kernel-level
differences: perturbing every initial weight by :data:`KERNEL_NOISE` (relative) moves
no metric beyond it (``tests/test_loop_golden.py`` checks that). At lr 1e-2 the toy
amplified 1e-7 perturbations to 1e-2 by step 5, and two CPUs reporting the same
``cpu_kind`` disagreed at 5e-3 (a CI failure); at lr 3e-3 a 1e-6 perturbation stays
within :data:`ATOL` on the loss and 5e-6 relative on the grad norm."""
KERNEL_NOISE = 1e-6
"""Relative weight perturbation the golden tolerance must absorb (float32 kernels that sum
in another order differ by ~1e-7 per operation)."""
CROSS_MACHINE_RTOL = 1e-2
"""Relative tolerance against a golden written on another kind of CPU (other ATen kernels,
AVX-512 with or without AMX / bf16)."""
ATOL = 1e-5
"""Absolute tolerance of the golden comparison. It rules for the loss, a mean of terms of
order 1 that nearly cancel (GRPO advantages sum to zero per group), so that its error is
absolute: a 1e-6 weight perturbation moved a loss of 3e-3 by 1.5e-6."""


@dataclass(frozen=True)
class ToyRunConfig:
    """The seeded toy run (the golden file records it; a change needs ``--update``)."""

    steps: int = 5
    """GRPO steps of the run."""
    seed: int = 0
    """Seed of the trainer, the prompt order and the sampling."""
    model_seed: int = 0
    """Seed of the tiny model's random weights."""
    num_prompts: int = 6
    """Distinct prompts (fewer than steps x batch, so the run crosses epochs)."""
    rollout_batch_size: int = 4
    """Prompts per step."""
    n_samples_per_prompt: int = 4
    """Samples per prompt (GRPO group size)."""
    global_batch_size: int = 8
    """Samples per optimizer step (two updates per step)."""
    response_len: int = 4
    """Tokens per response."""
    lr: float = 3e-3
    """AdamW learning rate: large enough that the reward rises within five steps, small
    enough that kernel-level differences are not amplified past :data:`RTOL`."""

    def trainer_config(self, model_folder: str | Path, backend: str = "torch") -> TorchEngineConfig:
        """The toy run's trainer settings for the model in ``model_folder``, for the torch
        or the megatron train backend."""
        settings: dict[str, Any] = {
            "model_path": str(model_folder),
            "optimizer": OptimizerConfig(lr=self.lr, weight_decay=0.0),
            "loss": ActorLossConfig(eps_clip=0.2, eps_clip_high=0.28),
            "micro_batch_size": 8,
            "seed": self.seed,
        }
        if backend == "megatron":
            from turnrl.grpo_core.megatron.engine import MegatronEngineConfig

            return MegatronEngineConfig(**settings)
        if backend != "torch":
            raise ValueError(f"backend must be torch or megatron, got {backend!r}")
        return TorchEngineConfig(**settings)

    def loop_config(self, save_interval: int = 0) -> LoopConfig:
        """The toy run's loop settings (checkpoint every ``save_interval`` steps, 0: never)."""
        return LoopConfig(
            num_rollout=self.steps,
            rollout_batch_size=self.rollout_batch_size,
            n_samples_per_prompt=self.n_samples_per_prompt,
            global_batch_size=self.global_batch_size,
            rollout_shuffle=True,
            save_interval=save_interval,
            seed=self.seed,
        )

    def __post_init__(self) -> None:
        for name in ("steps", "num_prompts", "response_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ToySample:
    """One toy rollout sample (the fields the loop trains on)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    group_id: str | None
    reward: float = 0.0
    num_turns: int = 1
    status: str = "completed"
    metadata: dict[str, Any] = field(default_factory=dict)


def toy_prompts(count: int) -> list[list[int]]:
    """``count`` distinct three-token prompts."""
    return [[1 + i, 40 + i, 90 + i] for i in range(count)]


def sampling_seed(seed: int, step: int, prompt: list[int]) -> int:
    """The generator seed of one prompt's group at one step."""
    return zlib.crc32(json.dumps([seed, step, prompt]).encode())


@torch.no_grad()
def sample_group(
    model: Any, prompt: list[int], n: int, response_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``n`` responses to ``prompt`` among :data:`CANDIDATES`.

    Returns:
        ``[n, response_len]`` token ids and their log-probs under the candidate softmax.
    """
    device = next(model.parameters()).device
    candidates = torch.tensor(CANDIDATES)
    ids = torch.tensor([prompt] * n, device=device)  # [n, P]
    picks, logps = [], []
    model.eval()
    for _ in range(response_len):
        logits = model(ids).logits[:, -1].float().cpu()  # [n, V]
        probs = torch.softmax(logits[:, candidates], dim=-1)  # [n, C]
        pick = torch.multinomial(probs, 1, generator=generator)  # [n, 1]
        picks.append(candidates[pick[:, 0]])
        logps.append(torch.log(probs.gather(1, pick))[:, 0])
        ids = torch.cat([ids, picks[-1][:, None].to(device)], dim=1)
    return torch.stack(picks, 1), torch.stack(logps, 1)


async def toy_reward(samples: list[ToySample]) -> list[float]:
    """Fraction of even token ids in each response."""
    return [sum(t % 2 == 0 for t in s.response_ids) / len(s.response_ids) for s in samples]


def build_toy_loop(
    model_folder: str | Path,
    config: ToyRunConfig,
    *,
    checkpoint_dir: str | Path | None = None,
    save_interval: int = 0,
    on_metrics: MetricsFn | None = None,
    on_samples: Callable[[int, list[ToySample]], None] | None = None,
    backend: str = "torch",
) -> GRPOLoop:
    """A GRPO loop on the toy task whose policy samples with the trainer's own model.

    Args:
        model_folder: A Hugging Face folder, e.g. from ``build_tiny_model``.
        config: The run's settings.
        checkpoint_dir: Where checkpoints go (with ``save_interval``).
        save_interval: Checkpoint every this many steps (0: never).
        on_metrics: Called with each step's metrics.
        on_samples: Called with ``(step being generated, samples)`` after each rollout.
        backend: The train backend, ``torch`` or ``megatron``.
    """
    trainer = make_engine(config.trainer_config(model_folder, backend))

    async def generate(prompts: list[list[int]], n: int) -> list[ToySample]:
        out = []
        for prompt in prompts:
            gen = torch.Generator().manual_seed(sampling_seed(config.seed, loop.step, prompt))
            ids, logps = sample_group(trainer.hf_snapshot(), prompt, n, config.response_len, gen)
            for row, row_logps in zip(ids.tolist(), logps.tolist(), strict=True):
                out.append(ToySample(prompt, row, [1] * len(row), row_logps, str(prompt)))
        if on_samples is not None:
            on_samples(loop.step, out)
        return out

    loop = GRPOLoop(
        config.loop_config(save_interval),
        trainer,
        toy_prompts(config.num_prompts),
        generate,
        toy_reward,
        weight_sync=None,
        pad_id=0,
        on_metrics=on_metrics,
        checkpoint_dir=checkpoint_dir,
    )
    return loop


@contextlib.contextmanager
def deterministic_torch(num_threads: int = 1) -> Iterator[None]:
    """Deterministic algorithms and a fixed intra-op thread count, restored on exit."""
    threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by CUDA determinism
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


def device_kind() -> str:
    """``cpu``, ``cuda`` or ``npu``: the device the trainer uses and the golden file's name."""
    from turnrl.npu_runtime.device import detect_device

    return detect_device().value


def cpu_kind() -> str:
    """The CPU's architecture and the kernels ATen dispatches to, e.g. ``x86_64 AVX512 amx``."""
    import platform

    flags = ""
    with contextlib.suppress(OSError):
        flags = Path("/proc/cpuinfo").read_text()
    extras = [name for name in ("amx_tile", "avx512_bf16") if f" {name}" in flags]
    return " ".join([platform.machine(), torch.backends.cpu.get_cpu_capability(), *extras])


def golden_rtol(golden: dict[str, Any], run: dict[str, Any]) -> float:
    """The file's tolerance when this run's CPU kind is the one that wrote it, else
    :data:`CROSS_MACHINE_RTOL` (a file without a CPU kind counts as another machine's)."""
    if run["device"] == "cpu" and golden.get("cpu") != run.get("cpu"):
        return CROSS_MACHINE_RTOL
    return float(golden.get("tolerance", {}).get("rtol", RTOL))


def run_golden(
    workdir: str | Path, config: ToyRunConfig | None = None, weight_noise: float = 0.0
) -> dict[str, Any]:
    """Run the toy task deterministically; returns the record a golden file holds.

    Args:
        workdir: Where the tiny model is written.
        config: The run's settings (default: the golden run's).
        weight_noise: Multiply every initial weight by ``1 + weight_noise * N(0, 1)``
            (seeded): a stand-in for another machine's kernels, to check the tolerance.
    """
    import asyncio

    config = config or ToyRunConfig()
    folder = build_tiny_model(Path(workdir) / "model", TinyModelConfig(seed=config.model_seed))
    with deterministic_torch():
        loop = build_toy_loop(folder, config)
        if weight_noise:
            noise = torch.Generator().manual_seed(config.seed)
            with torch.no_grad():
                for param in loop.trainer.hf_model.parameters():
                    scale = torch.randn(param.shape, generator=noise).to(param.device)
                    param.mul_(1 + weight_noise * scale)
        history = asyncio.run(loop.run())
    kind = device_kind()
    return {
        "device": kind,
        **({"cpu": cpu_kind()} if kind == "cpu" else {}),
        "torch": torch.__version__,
        "config": asdict(config),
        "tolerance": {"rtol": RTOL, "atol": ATOL},
        "steps": [{key: float(m[key]) for key in GOLDEN_METRICS} for m in history],
    }


def compare_golden(
    golden: dict[str, Any], run: dict[str, Any], rtol: float = RTOL, atol: float = ATOL
) -> list[str]:
    """Differences between a golden record and a fresh run (empty when they agree)."""
    if golden.get("config") != run["config"]:
        return [f"the golden run used config {golden.get('config')}, this one {run['config']}"]
    if len(golden.get("steps", [])) != len(run["steps"]):
        return [f"golden has {len(golden.get('steps', []))} steps, the run {len(run['steps'])}"]
    problems = []
    for number, (want, got) in enumerate(zip(golden["steps"], run["steps"], strict=True), 1):
        for key in GOLDEN_METRICS:
            if not math.isclose(got[key], want[key], rel_tol=rtol, abs_tol=atol):
                problems.append(f"step {number} {key}: golden {want[key]!r}, got {got[key]!r}")
    return problems


def default_golden_dir() -> Path:
    """``tests/golden`` of this package's source tree (absent in an installed wheel)."""
    return Path(__file__).resolve().parents[4] / "tests" / "golden"


def golden_file(kind: str, folder: Path | None = None) -> Path:
    """The golden file of one device kind, e.g. ``tests/golden/loop_cpu.json``."""
    return (folder or default_golden_dir()) / f"loop_{kind}.json"


def main(argv: list[str] | None = None) -> int:
    """Run the golden toy run; compare with (or ``--update``) the device's golden file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the golden file")
    parser.add_argument("--golden-dir", type=Path, default=None, help="default: tests/golden")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="turnrl-golden-") as tmp:
        run = run_golden(tmp)
    path = golden_file(run["device"], args.golden_dir)
    print(json.dumps(run, indent=2))
    if args.update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
        return 0
    if not path.is_file():
        print(f"no golden file {path}; create it with --update", file=sys.stderr)
        return 2
    golden = json.loads(path.read_text())
    problems = compare_golden(golden, run, rtol=golden_rtol(golden, run))
    for problem in problems:
        print(problem, file=sys.stderr)
    print("matches" if not problems else f"{len(problems)} differences", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
