"""Write a synthetic rollout file of a chosen GRPO shape, for benchmarks and GPU A/B runs.

    python tools/make_synthetic_rollouts.py --out r.parquet --groups 8 --responses 16 \
        --prompt-len 4096 --response-len 1024 [--response-len-min 256] [--vocab-size 151936]

Random token ids, 0/1 rewards and their group-normalised advantages (the same estimator as the
training data path). Response lengths are uniform in [--response-len-min, --response-len]
(equal to --response-len when no minimum is given), so the packer sees the ragged groups real
rollouts have. No old/reference logprobs: the training step recomputes them.

--replicate writes the same rollouts with every response as its own group of one (the prompt
copied N times): run through the DualKV path it is exactly the replicated batch, on the same
attention kernel, so an A/B of the two files isolates what deduplication saves.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dualkv.data import RolloutGroup, write_rollouts  # noqa: E402
from megatron_dualkv.data.advantages import AdvantageEstimator, compute_advantages  # noqa: E402


def make_synthetic_rollouts(groups: int, responses: int, prompt_len: int, response_len: int,
                            response_len_min: int | None, vocab_size: int, seed: int) -> list[RolloutGroup]:
    if min(groups, responses, prompt_len, response_len) < 1:
        raise ValueError("groups, responses, prompt length and response length must all be >= 1")
    lo = response_len if response_len_min is None else response_len_min
    if not 1 <= lo <= response_len:
        raise ValueError(f"--response-len-min must lie in [1, --response-len], got {lo}")
    rng = np.random.default_rng(seed)
    plain = []
    for g in range(groups):
        lengths = rng.integers(lo, response_len + 1, size=responses)
        plain.append(dict(
            group_id=f"synthetic-{g:05d}",
            prompt=rng.integers(0, vocab_size, size=prompt_len),
            responses=[rng.integers(0, vocab_size, size=int(r)) for r in lengths],
            rewards=(rng.random(responses) < 0.5).astype(np.float64),
        ))
    records = [RolloutGroup(**d) for d in plain]
    advantages = compute_advantages(records, AdvantageEstimator())
    return [RolloutGroup(**{**d, "advantages": a}) for d, a in zip(plain, advantages)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output file (.parquet or .jsonl)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--responses", type=int, default=16, help="N, responses per group")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--response-len", type=int, default=1024, help="longest response")
    ap.add_argument("--response-len-min", type=int, default=None, help="shortest response (default: all equal)")
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicate", action="store_true", help="one group per response (prompt copied)")
    args = ap.parse_args()
    records = make_synthetic_rollouts(args.groups, args.responses, args.prompt_len, args.response_len,
                                      args.response_len_min, args.vocab_size, args.seed)
    if args.replicate:
        records = [RolloutGroup(group_id=f"{r.group_id}-{i}", prompt=r.prompt, responses=[resp], advantages=[a])
                   for r in records for i, (resp, a) in enumerate(zip(r.responses, r.advantages))]
    write_rollouts(records, args.out)
    packed = sum(len(r.prompt) + sum(r.response_lengths) for r in records)
    replicated = sum(len(r.prompt) * r.num_responses + sum(r.response_lengths) for r in records)
    print(f"wrote {len(records)} groups to {args.out}: {packed} packed tokens, {replicated} replicated "
          f"({replicated / packed:.2f}x)")


if __name__ == "__main__":
    main()
