"""Test-wide settings (deterministic CPU math, quiet third-party warnings) and shared fixtures."""

import os
import warnings

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*absl.logging.*")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="module")
def pgs():
    """World-size-1 gloo group + Megatron model parallelism (TP=EP=1) with the CPU shims, restored
    after the module: the process groups of the single-process model tests."""
    from megatron_cpu import cuda_rng_state_on_cpu, cuda_runtime_as_cpu, gloo_world_of_one, model_parallel

    with gloo_world_of_one(), cuda_runtime_as_cpu(), cuda_rng_state_on_cpu(), model_parallel(tp=1) as collection:
        yield collection


@pytest.fixture
def three_groups():
    """make(seed, vocab) -> three groups "a", "b", "c" of random token ids below vocab: P = 5, 2, 7;
    N = 3, 2, 1; response lengths 1..6 (R = 1 included). The model and checkpoint tests' micro-batch."""
    from megatron_dualkv import Group

    def make(seed: int, vocab: int) -> list:
        g = torch.Generator().manual_seed(seed)
        ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
        return [
            Group.of(ids(5), [ids(3), ids(1), ids(4)], name="a"),
            Group.of(ids(2), [ids(6), ids(2)], name="b"),
            Group.of(ids(7), [ids(1)], name="c"),
        ]

    return make
