"""Math reward throughput: turnrl.rewards' three modes vs calling math-verify directly.

Generates typical AIME/DAPO-like (response, ground truth) pairs — integers (mostly),
fractions, radicals and expressions written in equivalent or wrong forms — and scores the
same items, in the same run, with:

- `math_verify_direct`: `math_verify.verify(parse(gold), parse(response))` per item (the
  usual way to call it; its own signal-based timeouts, main thread);
- `strict`, `normalized`, `math_verify`: `turnrl.rewards.score_math` in this process;
- `math_verify_batch`: `await score_batch(...)` over a warm ScoringPool (per-item timeouts).

Prints one JSON object: items/s, p50/p99 latency, the speed-up over math-verify and how
often our `math_verify` verdict agrees with math-verify's.

    uv run --package turnrl-rewards python benchmarks/math_reward.py --items 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from collections.abc import Callable

from math_verify import parse, verify

from turnrl.rewards import (
    MathItem,
    MathRewardConfig,
    PoolConfig,
    ScoringPool,
    score_batch,
    score_math,
)

FILLER = "We compute the required quantity step by step, checking each case carefully. "


def _pair(rng: random.Random) -> tuple[str, str]:
    """One (response, ground truth) pair; about 70 % correct."""
    kind = rng.random()
    correct = rng.random() < 0.7
    if kind < 0.6:  # AIME: an integer 0..999
        truth = str(rng.randint(0, 999))
        answer = truth if correct else str((int(truth) + rng.randint(1, 50)) % 1000)
    elif kind < 0.8:  # a fraction, sometimes written differently
        p, q = rng.randint(1, 40), rng.randint(2, 40)
        truth = f"\\frac{{{p}}}{{{q}}}"
        if correct:
            answer = rng.choice(
                [truth, f"\\dfrac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\frac{{{2 * p}}}{{{2 * q}}}"]
            )
        else:
            answer = f"\\frac{{{p + 1}}}{{{q}}}"
    else:  # radicals and expressions, equivalent forms need algebra
        a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
        truth = f"{a}\\sqrt{{{b}}}"
        if correct:
            answer = rng.choice([truth, f"\\sqrt{{{a * a * b}}}", f"{a} \\sqrt{{{b}}}"])
        else:
            answer = f"{a + 1}\\sqrt{{{b}}}"
    response = FILLER * rng.randint(2, 8) + f"Therefore the answer is $\\boxed{{{answer}}}$."
    return response, truth


def _time_each(items: list[tuple[str, str]], fn: Callable[[str, str], bool]) -> dict[str, object]:
    latencies, verdicts = [], []
    start = time.perf_counter()
    for response, truth in items:
        t0 = time.perf_counter()
        verdicts.append(bool(fn(response, truth)))
        latencies.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    latencies.sort()
    return {
        "items_per_s": round(len(items) / total, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 3),
        "accuracy": round(sum(verdicts) / len(verdicts), 3),
        "_verdicts": verdicts,
    }


def _direct(response: str, truth: str) -> bool:
    return bool(verify(parse(f"${truth}$"), parse(response)))


async def _batch(items: list[tuple[str, str]], workers: int) -> dict[str, object]:
    config = MathRewardConfig(mode="math_verify", timeout_s=5)
    batch = [MathItem(r, t) for r, t in items]
    async with ScoringPool(PoolConfig(num_workers=workers)) as pool:
        await score_batch(batch[:20], config, pool=pool)  # warm the workers
        start = time.perf_counter()
        scores = await score_batch(batch, config, pool=pool)
        total = time.perf_counter() - start
    return {
        "items_per_s": round(len(items) / total, 1),
        "workers": workers,
        "symbolic_items": sum(s.path == "symbolic" for s in scores),
        "failed_items": sum(s.path in ("timeout", "error") for s in scores),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    items = [_pair(rng) for _ in range(args.items)]
    _direct(*items[0]), score_math(*items[0])  # first-call warm-up for both
    results: dict[str, dict[str, object]] = {"math_verify_direct": _time_each(items, _direct)}
    for mode in ("strict", "normalized", "math_verify"):
        config = MathRewardConfig(mode=mode)  # type: ignore[arg-type]
        results[mode] = _time_each(items, lambda r, t, c=config: score_math(r, t, c).correct)
    baseline = results["math_verify_direct"]
    for mode in ("strict", "normalized", "math_verify"):
        results[mode]["speedup_vs_math_verify"] = round(
            float(results[mode]["items_per_s"]) / float(baseline["items_per_s"]),
            2,  # type: ignore[arg-type]
        )
    ours, theirs = results["math_verify"]["_verdicts"], baseline["_verdicts"]
    agreement = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(items)  # type: ignore[arg-type]
    for result in results.values():
        result.pop("_verdicts")
    results["math_verify_batch"] = asyncio.run(_batch(items, args.workers))
    print(
        json.dumps(
            {
                "items": len(items),
                "seed": args.seed,
                "results": results,
                "math_verify_mode_agreement_with_direct": round(agreement, 4),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
