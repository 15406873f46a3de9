"""Time turnrl's GRPO formulas against verl's `core_algos` on the same tensors; prints JSON.

256 samples x 4096 tokens, one CPU thread, fp32. Measures the GRPO advantage (16 samples
per group, broadcast to tokens), the vanilla PPO-clip policy loss with token-mean
(forward, and forward + backward), the low-variance KL and the token-mean aggregation,
and the largest absolute difference between the two implementations' outputs.

The baseline is verl's `core_algos` when `verl` imports (verl 0.9.1 installs with
`--no-deps` plus packaging, ray, tensordict, omegaconf, transformers, codetiming, orjson);
otherwise a straightforward reference implementation written here, and the JSON says so.

    python benchmarks/grpo_losses.py          # turnrl-grpo-core (and optionally verl) installed
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from turnrl.grpo_core.algos import aggregate_loss, compute_advantages, kl_penalty, policy_loss

B, L, GROUP = 256, 4096, 16


def timed_pair(
    ours_fn: Callable[[], Any], base_fn: Callable[[], Any], reps: int = 21
) -> tuple[float, float]:
    """Median wall times (ms) of two functions, interleaved so load drift hits both alike."""
    for fn in (ours_fn, base_fn, ours_fn, base_fn):  # warm-up
        fn()
    a: list[float] = []
    b: list[float] = []
    for _ in range(reps):
        for fn, out in ((ours_fn, a), (base_fn, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return 1000 * statistics.median(a), 1000 * statistics.median(b)


class _VerlActorConfig:
    """The fields of verl's ActorConfig that `compute_policy_loss_vanilla` reads."""

    clip_ratio, clip_ratio_low, clip_ratio_high = 0.2, 0.2, 0.28
    global_batch_info: ClassVar[dict[str, Any]] = {}

    def get(self, key: str, default: Any) -> Any:
        return {"clip_ratio_c": 3.0}.get(key, default)


def verl_baseline() -> dict[str, Callable[..., torch.Tensor]] | None:
    """verl's functions adapted to (inputs) -> tensor, or None when verl is not installed."""
    try:
        from verl.trainer.ppo import core_algos as va  # type: ignore[import-not-found]
    except Exception:
        return None
    cfg = _VerlActorConfig()
    return {
        "advantage": lambda tr, mask, idx: va.compute_grpo_vectorized_outcome_advantage(
            tr, mask, idx.numpy()
        )[0],
        "advantage_loop": lambda tr, mask, idx: va.compute_grpo_outcome_advantage(
            tr, mask, idx.numpy()
        )[0],
        "policy_loss": lambda lp, old, adv, mask: va.compute_policy_loss_vanilla(
            old, lp, adv, mask, "token-mean", cfg
        )[0],
        "low_var_kl": lambda lp, ref: va.kl_penalty(lp, ref, "low_var_kl"),
        "token_mean": lambda loss, mask: va.agg_loss(loss, mask, "token-mean"),
    }


def naive_baseline() -> dict[str, Callable[..., torch.Tensor]]:
    """Straightforward reference implementations (used when verl is absent)."""

    def advantage(tr: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        scores = tr.sum(-1)
        out = torch.zeros_like(scores)
        for g in idx.unique():
            sel = idx == g
            out[sel] = (scores[sel] - scores[sel].mean()) / (scores[sel].std() + 1e-6)
        return out[:, None] * mask

    def loss(
        lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        mat = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        mat = torch.where(adv < 0, torch.minimum(mat, -adv * 3.0), mat)
        return (mat * mask).sum() / mask.sum()

    def k3(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        kl = torch.clamp(ref - lp, -20, 20)
        return torch.clamp(kl.exp() - kl - 1, -10, 10)

    return {
        "advantage": advantage,
        "policy_loss": loss,
        "low_var_kl": k3,
        "token_mean": lambda loss_mat, mask: (loss_mat * mask).sum() / mask.sum(),
    }


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random log-probs, masks with ragged lengths, grouped rewards."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(L // 8, L + 1, (B,), generator=gen)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (B,), generator=gen).float()
    token_rewards = torch.zeros(B, L)
    token_rewards[torch.arange(B), lengths - 1] = rewards
    old = -torch.rand(B, L, generator=gen) * 3
    return {
        "mask": mask,
        "rewards": rewards,
        "token_rewards": token_rewards,
        "index": torch.arange(B) // GROUP,
        "old": old,
        "logp": old + torch.randn(B, L, generator=gen) * 0.1,
        "ref": old + torch.randn(B, L, generator=gen) * 0.1,
    }


def ours(x: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """turnrl's versions of each measured computation, closed over the inputs."""
    adv = compute_advantages(x["rewards"], x["index"], "grpo", x["mask"])

    def loss(lp: torch.Tensor) -> torch.Tensor:
        mat = policy_loss(lp, x["old"], adv, x["mask"]).loss_mat
        return aggregate_loss(mat, x["mask"], "token-mean")

    return {
        "advantage": lambda: compute_advantages(x["rewards"], x["index"], "grpo", x["mask"]),
        "policy_loss": lambda: loss(x["logp"]),
        "policy_loss_fwd_bwd": lambda: loss(x["logp"].clone().requires_grad_()).backward(),
        "low_var_kl": lambda: kl_penalty(x["logp"], x["ref"], "low_var_kl"),
        "token_mean": lambda: aggregate_loss(x["logp"], x["mask"], "token-mean"),
    }


def theirs(
    x: dict[str, torch.Tensor], base: dict[str, Callable[..., torch.Tensor]]
) -> dict[str, Callable[[], Any]]:
    """The baseline's versions of the same computations."""
    adv = base["advantage"](x["token_rewards"], x["mask"], x["index"])
    fns: dict[str, Callable[[], Any]] = {
        "advantage": lambda: base["advantage"](x["token_rewards"], x["mask"], x["index"]),
        "policy_loss": lambda: base["policy_loss"](x["logp"], x["old"], adv, x["mask"]),
        "policy_loss_fwd_bwd": lambda: base["policy_loss"](
            x["logp"].clone().requires_grad_(), x["old"], adv, x["mask"]
        ).backward(),
        "low_var_kl": lambda: base["low_var_kl"](x["logp"], x["ref"]),
        "token_mean": lambda: base["token_mean"](x["logp"], x["mask"]),
    }
    if "advantage_loop" in base:
        fns["advantage_loop"] = lambda: base["advantage_loop"](
            x["token_rewards"], x["mask"], x["index"]
        )
    return fns


def main() -> None:
    torch.set_num_threads(1)
    base = verl_baseline()
    baseline_name = (
        "verl.trainer.ppo.core_algos"
        if base is not None
        else "naive reference (verl not importable)"
    )
    base = base or naive_baseline()
    x = make_inputs()
    mine, other = ours(x), theirs(x, base)
    results = {}
    for name, fn in mine.items():
        t_ours, t_base = timed_pair(fn, other[name])
        entry = {
            "turnrl_ms": round(t_ours, 3),
            "baseline_ms": round(t_base, 3),
            "speedup": round(t_base / t_ours, 2),
        }
        if name != "policy_loss_fwd_bwd":
            entry["max_abs_diff"] = float((fn() - other[name]()).abs().max())
        results[name] = entry
    if "advantage_loop" in other:
        loop_ms = timed_pair(other["advantage_loop"], other["advantage_loop"], reps=3)[0]
        results["advantage"]["baseline_loop_version_ms"] = round(loop_ms, 3)
    print(
        json.dumps(
            {
                "benchmark": "grpo_losses",
                "shape": [B, L],
                "threads": 1,
                "dtype": "float32",
                "baseline": baseline_name,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
