"""Packing utilisation of `pack_micro_batches` on long-tailed sample lengths; prints JSON.

Lengths are log-normal (median ~1.5k tokens, a long tail up to the context limit), the
shape of multi-turn agent episodes. The baseline, measured in the same run, is next-fit in
arrival order (open a new micro-batch when the next sample does not fit), with the micro-
batch count rounded up so every rank gets the same number, as a simple dynamic batcher does.

    uv run --only-group dev nox -s "tests-3.11(package='grpo-core')" -R -- --co -q  # env
    .nox/tests-3-11-package-grpo-core/bin/python benchmarks/packing.py
"""

from __future__ import annotations

import json
import math
import random
import time

from turnrl.grpo_core.algos import pack_micro_batches


def long_tailed_lengths(n: int, cap: int, seed: int) -> list[int]:
    """`n` log-normal lengths (median 1500, sigma 0.9) clipped to [64, cap]."""
    rng = random.Random(seed)
    return [min(cap, max(64, round(rng.lognormvariate(math.log(1500), 0.9)))) for _ in range(n)]


def next_fit_utilisation(lengths: list[int], max_tokens: int, dp_size: int) -> float:
    """Utilisation of arrival-order next-fit, bins rounded up to a multiple of dp_size."""
    bins, load = 0, max_tokens + 1
    for n in lengths:
        if load + n > max_tokens:
            bins, load = bins + 1, 0
        load += n
    bins = math.ceil(bins / dp_size) * dp_size
    return sum(lengths) / (bins * max_tokens)


def run_case(num_samples: int, max_tokens: int, dp_size: int, seeds: range) -> dict[str, object]:
    """Pack several seeded batches; report mean/min utilisation and the baseline's."""
    utils, base, bound, times, imbalance = [], [], [], [], []
    for seed in seeds:
        lengths = long_tailed_lengths(num_samples, max_tokens, seed)
        start = time.perf_counter()
        plan = pack_micro_batches(lengths, max_tokens, dp_size)
        times.append(time.perf_counter() - start)
        utils.append(plan.utilisation)
        base.append(next_fit_utilisation(lengths, max_tokens, dp_size))
        # Best possible: the token lower bound on micro-batches, rounded up to equal counts.
        fewest = math.ceil(math.ceil(sum(lengths) / max_tokens) / dp_size) * dp_size
        bound.append(sum(lengths) / (fewest * max_tokens))
        per_rank = plan.rank_tokens(lengths)
        imbalance.append(max(per_rank) / (sum(per_rank) / len(per_rank)))
    return {
        "num_samples": num_samples,
        "max_tokens": max_tokens,
        "dp_size": dp_size,
        "seeds": len(seeds),
        "utilisation_mean": round(sum(utils) / len(utils), 4),
        "utilisation_min": round(min(utils), 4),
        "upper_bound_equal_counts_mean": round(sum(bound) / len(bound), 4),
        "baseline_next_fit_utilisation_mean": round(sum(base) / len(base), 4),
        "max_rank_tokens_over_mean": round(max(imbalance), 4),
        "plan_ms_mean": round(1000 * sum(times) / len(times), 2),
    }


def main() -> None:
    cases = [
        run_case(256, 16384, 4, range(20)),  # ReTool-like: 16k context, 4 ranks
        run_case(64, 16384, 4, range(20)),  # small batch
        run_case(512, 6144, 8, range(20)),  # --max-tokens-per-gpu 6144 with 6k-capped samples
    ]
    print(json.dumps({"benchmark": "packing", "cases": cases}, indent=2))


if __name__ == "__main__":
    main()
