"""The warp-specialized kernels' synchronization protocols, replayed on the host under random
interleavings (csrc/ws_pipeline_model.py): the forward (one query tile per CTA, and persistent
CTAs taking several), the backward (both dQ modes, 64- and 80-row steps, a prompt tail's tile), the deterministic
dK/dV kernel's overlapped walk and the ws dQ kernel. Each run
checks that no MMA reads a stage holding another tile, that no TMA lands in a stage still read,
that the turns balance, and that nothing deadlocks. Each mutation (a protocol bug the kernels
once had or could have) must fail, so the checks are known to bite."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "csrc"))
import ws_pipeline_model as model  # noqa: E402

STEPS = list(range(1, 10)) + [20]
SEEDS = range(40)


@pytest.mark.parametrize("n", STEPS)
def test_forward_and_backward_protocols(n):
    for seed in SEEDS:
        model.run(n, seed)
        model.run_persistent(n, seed)  # query tiles one after another on one ring, both ring depths
        # consumer 0's diagonal after its loop, consumer 1 without rows: alone, together, in a row
        model.run(n, seed, diag=[0]); model.run(n, seed, idle=[0])
        model.run_persistent(n, seed, diag=[0, 2, 3], idle=[1, 2])
        model.run_persistent(n, seed, diag=[1, 3], idle=[0, 1, 2, 3])
        for tma_dq in (False, True):
            for d128 in (True, False):
                model.run_bwd(n, seed, d128=d128, tma_dq=tma_dq)
        for turns in (True, False):  # 80-row steps, the default at head dim 128
            model.run_bwd(n, seed, tma_dq=True, turns=turns, wide=True)
            # a response tile holding its prompt's tail keys (loaded over the K/V box's first rows)
            model.run_bwd(n, seed, tma_dq=True, turns=turns, wide=True, tail=True)
        model.run_bwd(n, seed, d128=False, tma_dq=True, tail=True)


@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("stages", [4, 6])  # the dQ kernel's ring at head dim 128 and 64
def test_dq_kernel_protocol(n, stages):
    for seed in SEEDS:
        model.run_dq(n, seed, stages=stages)
        model.run_dq(n, seed, stages=stages, skip0=True)  # consumer 0's masked last tile skipped
        model.run_dq(n, seed, stages=stages, idle1=True)  # consumer 1 without rows
        model.run_dq(n, seed, stages=stages, skip0=True, idle1=True)


@pytest.mark.parametrize("n", STEPS)
def test_deterministic_overlapped_walk_protocol(n):
    for seed in SEEDS:
        model.run_det_overlap(n, seed)
        for skip1 in range(1, min(n, 8) + 1):  # consumer 1 stopping before the diagonal steps (group <= 8)
            model.run_det_overlap(n, seed, skip1=skip1)


@pytest.mark.parametrize("run_fn, mutations", [
    (model.run_persistent, model.FWD_MUTATIONS),
    (model.run_dq, model.DQ_MUTATIONS),
    (model.run_det_overlap, model.DET_MUTATIONS),
])
def test_protocol_mutations_are_caught(run_fn, mutations):
    model.check_mutations(run_fn, mutations)


def test_backward_mutations_are_caught():
    model.check_bwd_mutations(seeds=60)
