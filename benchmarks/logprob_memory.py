"""Peak extra CPU memory of chunked vs naive log-probs at a 151,936 vocabulary; prints JSON.

Each measurement runs in a fresh subprocess: it builds the inputs (hidden states `[N, H]`,
output weight `[V, H]`, labels), records its peak RSS (`ru_maxrss`), runs one method, and
reports the growth of the peak RSS — the extra memory the method needed at its worst.
tracemalloc cannot see torch's allocations, and torch keeps no CPU allocator statistics.

- naive: `logits = hidden @ weight.T`, `log_softmax`, `gather` (in the input dtype, as
  a straightforward implementation does; an fp32 log_softmax would need twice as much).
- chunked: `chunked_logprobs(..., chunk_size)` (fp32 per chunk, never `[N, V]`).

Forward runs under `torch.no_grad()` (the log-prob recompute of the old/reference policy);
`--backward` measures forward + backward with gradients to hidden and weight at a smaller N.
The hidden size is small (64) so the matmul stays fast on a CPU; the logits, the only large
buffers, do not depend on it.

    python benchmarks/logprob_memory.py                # 16,384 tokens x 151,936 vocab, bf16
    python benchmarks/logprob_memory.py --backward     # forward + backward, 4,096 tokens
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from turnrl.grpo_core.algos import chunked_logprobs

VOCAB = 151_936
HIDDEN = 64


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(
    method: str, tokens: int, dtype_name: str, chunk_size: int, backward: bool
) -> dict[str, object]:
    """Run one method in this process and report its peak extra memory and time."""
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype).requires_grad_(backward)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(dtype).requires_grad_(backward)
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
    before = _peak_rss_bytes()
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if method == "naive":
            logits = hidden @ weight.T
            logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        else:
            logp, _ = chunked_logprobs(hidden, weight, labels, chunk_size)
        if backward:
            logp.float().sum().backward()
    seconds = time.perf_counter() - start
    return {
        "method": method,
        "peak_extra_gib": round((_peak_rss_bytes() - before) / 2**30, 3),
        "seconds": round(seconds, 2),
        "logp_sum": float(logp.float().sum()),
    }


def measure(
    method: str, tokens: int, dtype: str, chunk_size: int, backward: bool
) -> dict[str, object]:
    """Run `worker` in a fresh Python process and parse its JSON."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        method,
        "--tokens",
        str(tokens),
        "--dtype",
        dtype,
        "--chunk-size",
        str(chunk_size),
    ] + (["--backward"] if backward else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["naive", "chunked"])
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    tokens = args.tokens or (4096 if args.backward else 16384)
    if args.worker:
        print(json.dumps(worker(args.worker, tokens, args.dtype, args.chunk_size, args.backward)))
        return
    naive = measure("naive", tokens, args.dtype, args.chunk_size, args.backward)
    chunked = measure("chunked", tokens, args.dtype, args.chunk_size, args.backward)
    ratio = float(chunked["peak_extra_gib"]) / float(naive["peak_extra_gib"])  # type: ignore[arg-type]
    report = {
        "benchmark": "logprob_memory",
        "tokens": tokens,
        "vocab": VOCAB,
        "hidden": HIDDEN,
        "dtype": args.dtype,
        "chunk_size": args.chunk_size,
        "backward": args.backward,
        "naive_logits_gib": round(
            tokens * VOCAB * torch.finfo(getattr(torch, args.dtype)).bits / 8 / 2**30, 3
        ),
        "naive": naive,
        "chunked": chunked,
        "chunked_over_naive_peak": round(ratio, 4),
        "target_met_le_1_8": ratio <= 1 / 8,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
