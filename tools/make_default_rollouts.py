"""Write the small rollout file shipped for the demo: megatron_dualkv/data/default_rollouts.jsonl.

Random tokens for a tiny Qwen3-shaped model with a 512-token vocabulary: 24 groups, prompts of
16..96 tokens, 2..8 responses of 1..64 tokens, 0/1 verifier-style rewards and their GRPO advantages
(group mean / std, to 12 significant digits). Every fourth group is multi-turn: a span in the middle
of some responses (a tool output) has loss mask 0. No old-policy logprobs: the training step
recomputes them.

    python tools/make_default_rollouts.py [--out PATH] [--seed 2026]

Deterministic: the same seed writes the same bytes (tests check the committed file against it).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dualkv.data import DEFAULT_ROLLOUTS, DEFAULT_ROLLOUTS_VOCAB_SIZE, RolloutGroup, write_rollouts  # noqa: E402
from megatron_dualkv.data.advantages import AdvantageEstimator, compute_advantages  # noqa: E402

SEED = 2026
NUM_GROUPS = 24


def make_default_rollouts(seed: int = SEED, num_groups: int = NUM_GROUPS,
                          vocab_size: int = DEFAULT_ROLLOUTS_VOCAB_SIZE) -> list[RolloutGroup]:
    rng = np.random.default_rng(seed)
    plain = []
    for g in range(num_groups):
        p = int(rng.integers(16, 97))
        n = int(rng.integers(2, 9))
        lengths = rng.integers(1, 65, size=n)
        prompt = rng.integers(0, vocab_size, size=p)
        responses = [rng.integers(0, vocab_size, size=int(r)) for r in lengths]
        # success probability per prompt; small groups are still sometimes all right or all wrong
        # (advantage 0), as in real GRPO batches
        rate = float(rng.uniform(0.2, 0.8))
        rewards = (rng.random(n) < rate).astype(np.float64)
        mask = None
        if g % 4 == 3:
            mask = []
            for r in lengths:
                m = np.ones(int(r), dtype=np.int64)
                if r >= 8:  # a tool-output span that the policy did not generate
                    a = int(rng.integers(1, r // 2))
                    b = int(rng.integers(a + 1, r))
                    m[a:b] = 0
                mask.append(m)
        plain.append(dict(group_id=f"default-{g:03d}", prompt=prompt, responses=responses, rewards=rewards,
                          loss_mask=mask))
    records = [RolloutGroup(**d) for d in plain]
    advantages = compute_advantages(records, AdvantageEstimator())
    # Stored to 12 significant digits: torch builds differ in the last bit of (r - mean) / (std + eps)
    # (0.7071057811879616 here, ...617 where the file was first written), and the file must
    # regenerate byte for byte wherever the tests run.
    advantages = [tuple(float(f"{x:.12g}") for x in a) for a in advantages]
    return [RolloutGroup(**{**d, "advantages": a}) for d, a in zip(plain, advantages)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_ROLLOUTS)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    records = make_default_rollouts(args.seed)
    write_rollouts(records, args.out)
    tokens = sum(len(r.prompt) + sum(r.response_lengths) for r in records)
    print(f"wrote {len(records)} groups, {sum(r.num_responses for r in records)} responses, {tokens} packed tokens "
          f"to {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
