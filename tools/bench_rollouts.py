"""Time the data path at the scale of one GRPO step: write/read rollouts, plan, build one rank.

    python tools/bench_rollouts.py [--groups 256] [--dp 8] [--max-tokens 16384]

Random tokens, N=8, P 64..512, R 16..1024, rewards and per-token old logprobs (CPU only).
"""

import argparse
import os
import tempfile
import time

import numpy as np

from megatron_dualkv.data import RolloutGroup, read_rollouts, write_rollouts
from megatron_dualkv.packing import PackingConfig, build_micro_batches, flop_work_weights, plan_packing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16384)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    records = []
    for g in range(args.groups):
        lens = rng.integers(16, 1025, size=8)
        records.append(RolloutGroup(
            f"q{g}", rng.integers(0, 150_000, size=int(rng.integers(64, 513))),
            [rng.integers(0, 150_000, size=int(x)) for x in lens], rewards=rng.integers(0, 2, size=8).astype(float),
            old_logprobs=[-rng.exponential(size=int(x)) for x in lens]))
    tokens = sum(len(r.prompt) + sum(r.response_lengths) for r in records)
    print(f"{args.groups} groups, {tokens} packed tokens: built and validated in {time.perf_counter() - t:.2f} s")
    with tempfile.TemporaryDirectory() as d:
        for ext in ("parquet", "jsonl"):
            path = os.path.join(d, "rollouts." + ext)
            t = time.perf_counter()
            write_rollouts(records, path)
            w = time.perf_counter() - t
            t = time.perf_counter()
            read_rollouts(path)
            print(f"{ext:8s} write {w:.2f} s, read {time.perf_counter() - t:.2f} s, {os.path.getsize(path) / 2**20:.1f} MiB")
    cfg = PackingConfig(max_tokens=args.max_tokens, dp_size=args.dp, pad_to_multiple=8,
                        **flop_work_weights(num_layers=36, num_q_heads=32, head_dim=128, active_params=6.95e9))
    t = time.perf_counter()
    plan = plan_packing(records, cfg)
    s = plan.summary()
    print(f"plan {time.perf_counter() - t:.3f} s: {s['micro_batches_per_rank']} micro-batches per rank, "
          f"rank imbalance {s['rank_imbalance']:.4f}, {s['split_groups']} groups split")
    t = time.perf_counter()
    mbs = build_micro_batches(records, plan, 0)
    print(f"build rank 0: {time.perf_counter() - t:.2f} s for {sum(m.stats.tokens for m in mbs)} tokens; "
          f"dedup ratio {sum(m.stats.replicated_tokens for m in mbs) / sum(m.stats.tokens for m in mbs):.2f}")


if __name__ == "__main__":
    main()
