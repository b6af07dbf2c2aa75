"""Rows a context-parallel rank might hold, for the GPU tests of local queries (q holds some packed
rows, k and v all of them)."""
import random

import torch


def cp_like_rows(t, seed):
    """3 of 7 runs of [0, t), cut at random rows, ascending, on the GPU."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, t), 6))
    runs = list(zip([0] + cuts, cuts + [t]))
    return torch.cat([torch.arange(a, b) for a, b in sorted(rng.sample(runs, 3))]).to("cuda")
