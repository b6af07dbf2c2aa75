"""Multi-process equivalence over gloo: TP=2 == TP=1, EP=2 == EP=1, DP=2 == the single-rank sum.

Every run, parallel or not, goes through Megatron's training path: the model wrapped in Megatron's
DistributedDataParallel, `forward_backward_no_pipelining` with per-token loss
(`calculate_per_token_loss`), and `finalize_model_grads` (DP all-reduce, TP all-reduce of
qk-layernorm / sequence-parallel grads, division by the GLOBAL token count). The reference is the
same code on a world of one rank holding all micro-batches; its initial weights are sharded into
the parallel model, and the parallel model's gradients are gathered back to full tensors.

The worker functions (`train_step`) run in spawned processes (tests/megatron_cpu.GlooWorkers);
every comparison happens here in the pytest process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

from megatron_cpu import GlooWorkers

from megatron_dualkv.checkpoint.sharding import Placement, join_shards, parameter_placements, take_shard

VOCAB = 256  # qwen3_config("tiny") / ("tiny-moe"): hidden 64, 2 layers, 4 heads, 2 query groups; MoE 4 experts top-2

# float32 with reductions reordered by the parallel split: agreement to ~1e-6 relative.
RTOL = 2e-5


@dataclass(frozen=True)
class Case:
    """One parallel configuration of the tiny model."""

    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    moe: bool = False
    overrides: tuple = ()  # more config settings, (name, value) pairs: router losses, recomputation


# ------------------------------------------------------------------------------------------------
# Micro-batches (host data only: these cross the process boundary)
# ------------------------------------------------------------------------------------------------


def make_groups(seed: int, num_groups: int = 3) -> list:
    """Several GRPO groups: different prompt lengths, N = 3, 2, 1, a response of length 1."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()
    groups = [
        (ids(5), [ids(3), ids(1), ids(4)]),
        (ids(3), [ids(2), ids(5)]),
        (ids(4), [ids(3)]),
    ]
    return groups[:num_groups]


def make_microbatch(seed: int, pad_to_multiple: int = 1, num_groups: int = 3) -> dict:
    """A packed micro-batch and its rollout data: per-response advantages and per-edge reference
    logprobs (the k3 KL term makes the loss non-linear in the logprobs)."""
    from megatron_dualkv.layout import build_layout

    layout = build_layout(make_groups(seed, num_groups), vocab_size=VOCAB, pad_to_multiple=pad_to_multiple)
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "layout": layout,
        "advantages": torch.randn(layout.num_responses, generator=g),
        "ref_logprobs": -5.5 + 0.5 * torch.randn(layout.num_edges, generator=g),
    }


# ------------------------------------------------------------------------------------------------
# The model and loss under test (run inside the workers)
# ------------------------------------------------------------------------------------------------

LOSS_CONFIG = dict(clip_low=0.2, clip_high=0.28, kl_beta=0.05)


def model_config(case: Case):
    """The tiny Qwen3-shaped config (dense or MoE) for one parallel case, set up for Megatron's
    per-token-loss training path."""
    from megatron.core.distributed import finalize_model_grads
    from megatron_dualkv.megatron import qwen3_config

    return qwen3_config(
        "tiny-moe" if case.moe else "tiny",
        **dict(case.overrides),
        vocab_size=VOCAB, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=case.tp, expert_model_parallel_size=case.ep,
        sequence_parallel=case.sequence_parallel,
        calculate_per_token_loss=True, finalize_model_grads_func=finalize_model_grads,
    )


def build_model(kind: str, cfg, pgs):
    from megatron_dualkv.megatron import build_dualkv_model, build_replicated_model

    if kind == "dualkv":
        return build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    if kind == "replicated":
        return build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    raise ValueError(f"unknown model kind {kind!r}")


def edge_logprobs(kind: str, model, layout) -> torch.Tensor:
    """[E] logprobs at the layout's loss edges: DualKV on the packed micro-batch, or the stock
    model on the replicated batch (each response its own [prompt | response] row)."""
    from megatron_dualkv.megatron import replicated_logprobs

    if kind == "dualkv":
        return model(layout=layout).logprobs
    # the stock path reads attributes of the GPTModel itself, not of its DDP wrapper
    return replicated_logprobs(getattr(model, "module", model), layout).logprobs


def grpo_loss_sum(logprobs, mb: dict, global_num_tokens: float):
    """The GRPO loss of one micro-batch, token-mean over the global batch, times the global count:
    Megatron's per-token-loss path wants the micro-batch's share of the SUM and divides all
    gradients by the all-reduced token count itself (finalize_model_grads)."""
    from megatron_dualkv.loss import PolicyBatch, PolicyLossConfig, policy_loss

    batch = PolicyBatch(advantages=mb["advantages"], ref_logprobs=mb["ref_logprobs"])
    loss, _ = policy_loss(logprobs, batch, mb["layout"], PolicyLossConfig(**LOSS_CONFIG),
                          global_num_tokens=global_num_tokens)
    return loss * global_num_tokens


# ------------------------------------------------------------------------------------------------
# Sharding: full (TP=1, EP=1) parameter names and tensors <-> this rank's shards
# ------------------------------------------------------------------------------------------------

# The package's own placements (megatron_dualkv.checkpoint.sharding, which the HF export uses too),
# with the process groups dropped so that they travel back from the workers.


def rank_placements(model, pgs) -> dict[str, Placement]:
    """Local parameter name -> where it sits in the full (TP=1, EP=1) parameter."""
    return {n: replace(p, group=None, ep_group=None) for n, p in parameter_placements(model, pgs).items()}


# ------------------------------------------------------------------------------------------------
# One training step on one rank (runs inside the workers)
# ------------------------------------------------------------------------------------------------


def train_step(case: Case, microbatches_per_replica: list, full_weights: Optional[dict],
               kind: str = "dualkv", compare_replicated: bool = False, optimizer_step: bool = False) -> dict:
    """One training step of `kind` ("dualkv" or "replicated") for `case` on this rank.

    Loads `full_weights` sharded for this rank (None: the seeded initialisation, with the norm
    weights perturbed so that their gradient paths matter), runs this replica's micro-batches
    through Megatron's DDP, forward_backward_no_pipelining and finalize_model_grads, and returns
    logprobs, loss sums, router aux losses and every local gradient with its place in the full
    parameter. compare_replicated: also the stock model's logprobs on the replicated batch under
    the same parallelism (forward only, same weights). optimizer_step: then one step of
    Megatron's optimizer (SGD, clip_grad=0, no distributed optimizer), returning the updated
    parameters and the grad norm Megatron computes over the model-parallel shards.
    """
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_cpu import model_parallel

    rank = dist.get_rank()
    all_mbs = [mb for replica in microbatches_per_replica for mb in replica]
    global_num_tokens = float(sum(mb["layout"].num_edges for mb in all_mbs))
    with model_parallel(tp=case.tp, ep=case.ep) as pgs:
        cfg = model_config(case)
        model = build_model(kind, cfg, pgs)
        shards = rank_placements(model, pgs)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if full_weights is not None:
                    p.copy_(take_shard(full_weights[shards[n].full_name], shards[n]))
                elif "layernorm" in n:
                    p.add_(0.1 * torch.randn_like(p))
        initial = {shards[n].full_name: p.detach().clone() for n, p in model.named_parameters()}

        replicated = None
        if compare_replicated:
            base = build_model("replicated", cfg, pgs)
            base.load_state_dict(model.state_dict())
            with torch.no_grad():
                get_moe_metrics_tracker().clear()
                replicated = [edge_logprobs("replicated", base, mb["layout"]) for mb in microbatches_per_replica[_dp_index(case, rank)]]

        ddp = DistributedDataParallel(
            cfg.transformer,
            DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
            model,
            pg_collection=pgs,
        )
        ddp.zero_grad_buffer()
        get_moe_metrics_tracker().clear()
        mbs = microbatches_per_replica[_dp_index(case, rank)]
        logprobs, loss_sums = [], []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            lp = edge_logprobs(kind, model, mb["layout"])
            logprobs.append(lp.detach().clone())

            def loss_func(lp):
                loss_sum = grpo_loss_sum(lp, mb, global_num_tokens)
                loss_sums.append(loss_sum.detach().clone())
                count = torch.tensor(mb["layout"].num_edges, dtype=torch.int)
                return loss_sum, count, {"loss": loss_sum.detach()}

            return lp, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
            num_microbatches=len(mbs), seq_length=0, micro_batch_size=1, forward_only=False,
            pg_collection=pgs,
        )
        grads = {n: (shards[n], p.main_grad.detach().clone()) for n, p in model.named_parameters()}
        updated = grad_norm = None
        if optimizer_step:
            grad_norm, updated = sgd_step(ddp, shards)
        return {
            "rank": rank,
            "initial": initial,
            "grads": grads,
            "updated": updated,
            "grad_norm": grad_norm,
            "logprobs": logprobs,
            "loss_sums": loss_sums,
            "router_losses": recorded_router_losses(),
            "replicated_logprobs": replicated,
        }


def sgd_step(ddp, shards: dict) -> tuple[float, dict]:
    """One step of Megatron's optimizer on the DDP-reduced gradients: (grad norm, updated shards).

    SGD with weight decay: its update is linear in the gradient, so the parallel and the
    reference updates agree to the gradients' rounding (Adam's first step, ~lr*sign(g), turns
    rounding-level differences of near-zero gradients into lr-sized ones)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="sgd", lr=0.5, weight_decay=0.01, clip_grad=0.0, use_distributed_optimizer=False,
        params_dtype=torch.float32,
    )
    # the default groups already are gloo groups: Megatron's extra gloo copies are not created
    optimizer = get_megatron_optimizer(config, [ddp], use_gloo_process_groups=False)
    ok, grad_norm, _ = optimizer.step()
    assert ok, "Megatron's optimizer skipped the step"
    return float(grad_norm), {n: (shards[n], p.detach().clone()) for n, p in ddp.module.named_parameters()}


def recorded_router_losses() -> dict:
    """Per-layer MoE router losses as Megatron's tracker reports them, reduced over TP x CP only:
    summed over the group a metric names for reduction (with sequence parallelism each TP rank
    routes a slice of the tokens), averaged over TP x CP for a metric named for averaging. The
    data-parallel part of the report is left to the test (it sums over replicas instead)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    out = {}
    for name, entry in sorted(get_moe_metrics_tracker().metrics.items()):  # same order on every rank
        values = entry.values.detach().clone()
        if entry.reduce_group is not None:
            dist.all_reduce(values, group=entry.reduce_group)
        elif entry.avg_group is not None:
            group = ps.get_tensor_and_context_parallel_group()
            dist.all_reduce(values, group=group)
            values /= group.size()
        out[name] = values
    return out


def _dp_index(case: Case, rank: int) -> int:
    """Which data-parallel replica this rank belongs to (tp is the innermost dimension)."""
    return rank // case.tp


# ------------------------------------------------------------------------------------------------
# Comparisons (pytest process)
# ------------------------------------------------------------------------------------------------


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL,
                 atol: float = 0.0) -> None:
    """|actual - expected| <= rtol * max|expected| + atol elementwise (scale-aware for near-zero
    entries)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale + atol, f"{what}: max |diff| {err:.3e} > {rtol:.0e} x max|expected| {scale:.3e} + {atol:.1e}"


def gather_full_grads(results: list, key: str = "grads") -> dict:
    """Full tensors (gradients, or `key`) from every rank's shards; replicated shards must agree
    across ranks."""
    by_name: dict = {}
    for res in results:
        for local_name, (s, g) in res[key].items():
            by_name.setdefault(s.full_name, []).append((s, g, res["rank"]))
    full = {}
    for name, parts in by_name.items():
        s0 = parts[0][0]
        if s0.dim is None:
            for s, g, r in parts[1:]:
                assert_close(g, parts[0][1], f"{key} {name}: rank {r} vs rank {parts[0][2]} (replicated)")
            full[name] = parts[0][1]
            continue
        by_rank: dict = {}
        for s, g, r in parts:
            if s.rank in by_rank:
                assert_close(g, by_rank[s.rank], f"{key} {name}: rank {r} (replica of TP shard {s.rank})")
            by_rank[s.rank] = g
        assert sorted(by_rank) == list(range(s0.size)), f"{name}: missing TP shards {sorted(by_rank)}"
        full[name] = join_shards([by_rank[k] for k in range(s0.size)], s0)
    return full


def assert_grads_equal(full: dict, reference: dict, what: str) -> None:
    assert set(full) == set(reference), f"{what}: parameter sets differ: {set(full) ^ set(reference)}"
    for name, ref in reference.items():
        assert ref.abs().max() > 0, f"reference grad of {name} is all zero: the test would not see a bug"
        assert_close(full[name], ref, f"{what}: grad {name}")


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    # 4 workers: most tests use ranks 0-1, the TP x EP test all four. Timeout per task (~1 s each
    # on an idle machine); a hang fails after it instead of blocking CI.
    with GlooWorkers(4, timeout_s=240) as w:
        yield w


def reference(workers, case: Case, microbatches: list, kind: str = "dualkv",
              weights: Optional[dict] = None) -> dict:
    """TP=1, EP=1 on a world of one rank holding every micro-batch (`kind` model), with the
    optimizer step. Without `weights` its seeded initialisation becomes the test's weights."""
    ref_case = replace(case, tp=1, ep=1, sequence_parallel=False)
    return workers.run(train_step, ref_case, [microbatches], weights, kind, False, True, world_size=1)[0]


def parallel(workers, case: Case, microbatches_per_replica: list, weights: dict) -> list:
    """The DualKV step of `case` on tp x (number of replicas) ranks (replicated logprobs alongside
    unless SP), optimizer step."""
    return workers.run(train_step, case, microbatches_per_replica, weights, "dualkv",
                       not case.sequence_parallel, True, world_size=case.tp * len(microbatches_per_replica))


def reference_grads(ref: dict, key: str = "grads") -> dict:
    return {n: g for n, (s, g) in ref[key].items()}


def check_router_losses(got: dict, want: dict, what: str, moe: bool) -> None:
    """Every per-layer router loss the tracker recorded (load balancing, seq, z), accumulated over
    micro-batches; a MoE reference must have recorded a load-balancing loss, and none may be zero."""
    assert set(got) == set(want), f"{what}: router losses {sorted(got)} != {sorted(want)}"
    assert any("load_balancing" in k for k in want) == moe, f"{what}: router losses {sorted(want)} (moe={moe})"
    for name, w in want.items():
        assert (w != 0).all(), f"reference {name} has a zero layer: the comparison would be empty"
        assert_close(got[name], w, f"{what}: router {name} per layer")


def check_step(out: list, ref: dict, what: str) -> None:
    """Every gradient (gathered), Megatron's grad norm and every parameter update of the optimizer step."""
    assert_grads_equal(gather_full_grads(out), reference_grads(ref), what)
    for res in out:
        assert abs(res["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], (
            f"{what}: grad norm on rank {res['rank']} {res['grad_norm']} != {ref['grad_norm']}")
    updated, want = gather_full_grads(out, "updated"), reference_grads(ref, "updated")
    for name, w in want.items():
        initial = ref["initial"][name]
        step = w - initial
        assert step.abs().max() > 0, f"{name} did not move in the optimizer step"
        # the difference of two float32 parameters carries their rounding: a few eps x |w|
        atol = 8 * torch.finfo(torch.float32).eps * initial.abs().max().item()
        assert_close(updated[name] - initial, step, f"{what}: optimizer update of {name}", atol=atol)


def check_against_replicated(out: list, mbs_per_replica: list, case: Case) -> None:
    """The parallel DualKV logprobs equal the stock model's on the replicated batch run under the
    same parallelism (vocab-parallel cross entropy, TP/EP-split stock layers)."""
    for res in out:
        replica = _dp_index(case, res["rank"])
        for k, (got, want) in enumerate(zip(res["logprobs"], res["replicated_logprobs"])):
            assert_close(got, want, f"rank {res['rank']} micro-batch {k}: DualKV vs replicated logprobs")
        assert len(res["replicated_logprobs"]) == len(mbs_per_replica[replica])


def test_reference_dualkv_step_equals_replicated_step(workers):
    """Anchor for the parallel tests: on one rank, the DualKV training step (logprobs, GRPO loss,
    router aux loss, every gradient after Megatron's finalize) equals the stock model's step on
    the replicated batch, for the dense and the MoE model."""
    for moe in (False, True):
        case = Case(moe=moe)
        mbs = per_replica_microbatches(1)
        dual = reference(workers, case, mbs)
        base = reference(workers, case, mbs, kind="replicated", weights=dual["initial"])
        for k in range(len(mbs)):
            assert_close(dual["logprobs"][k], base["logprobs"][k], f"moe={moe} micro-batch {k}: logprobs")
            assert_close(dual["loss_sums"][k], base["loss_sums"][k], f"moe={moe} micro-batch {k}: loss")
        check_router_losses(dual["router_losses"], base["router_losses"], f"moe={moe} DualKV vs replicated", moe)
        check_step([base], dual, f"moe={moe} replicated vs DualKV")


# The Qwen3 default router loss, and the per-sequence variant with a z-loss on top.
AUX_LOSS = ()
SEQ_AUX_AND_Z_LOSS = (("moe_router_load_balancing_type", "seq_aux_loss"), ("moe_z_loss_coeff", 1e-3))
# Activation recomputation of every layer (Megatron's tensor_parallel.checkpoint under TP + SP).
FULL_RECOMPUTE = (("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 1))


@pytest.mark.parametrize(
    "case",
    [Case(tp=2), Case(tp=2, sequence_parallel=True),
     Case(tp=2, sequence_parallel=True, moe=True, overrides=AUX_LOSS),
     Case(tp=2, sequence_parallel=True, moe=True, overrides=SEQ_AUX_AND_Z_LOSS),
     Case(tp=2, sequence_parallel=True, overrides=FULL_RECOMPUTE)],
    ids=["dense", "dense-sp", "moe-sp", "moe-sp-seqaux-z", "dense-sp-recompute"],  # Megatron refuses MoE + TP training without SP
)
def test_tp2_equals_tp1(workers, case):
    """TP=2 (vocabulary, QKV/proj, MLP or expert MLP split; qk-layernorm / sequence-parallel norm
    grads all-reduced by finalize_model_grads) equals TP=1 with the same weights."""
    mbs = [make_microbatch(seed=10, pad_to_multiple=4)]  # 30 tokens + a padding segment of 2
    assert mbs[0]["layout"].num_tokens > mbs[0]["layout"].num_real_tokens
    ref = reference(workers, case, mbs)
    out = parallel(workers, case, [mbs], ref["initial"])
    for res in out:
        assert_close(res["logprobs"][0], ref["logprobs"][0], f"logprobs on rank {res['rank']}")
        assert_close(res["loss_sums"][0], ref["loss_sums"][0], f"loss on rank {res['rank']}")
        check_router_losses(res["router_losses"], ref["router_losses"], f"rank {res['rank']}", case.moe)
    if not case.sequence_parallel:
        check_against_replicated(out, [mbs], case)
    check_step(out, ref, f"TP=2 {case}")


def per_replica_microbatches(pad_to_multiple: int) -> list:
    """Two micro-batches of different token counts, one per data-parallel replica (a wrong
    normalisation, e.g. a mean of per-rank means, would then change the gradients)."""
    mbs = [make_microbatch(seed=20, pad_to_multiple=pad_to_multiple),
           make_microbatch(seed=30, pad_to_multiple=pad_to_multiple, num_groups=2)]
    assert mbs[0]["layout"].num_edges != mbs[1]["layout"].num_edges
    if pad_to_multiple > 1:  # 30 and 23 tokens: both carry a padding segment
        assert all(mb["layout"].num_tokens > mb["layout"].num_real_tokens for mb in mbs)
    return mbs


GROUPED_EXPERTS = (("moe_grouped_gemm", True),)  # GroupedGemmSequentialMLP (no TE)


@pytest.mark.parametrize("router", [AUX_LOSS, SEQ_AUX_AND_Z_LOSS, GROUPED_EXPERTS], ids=["aux", "seqaux-z", "grouped-gemm"])
def test_ep2_equals_ep1(workers, router):
    """MoE with the 4 experts split over 2 ranks (alltoall dispatcher); the two ranks are also DP
    replicas for the dense parameters, each with its own micro-batch. Reference: EP=1 on one rank
    holding both micro-batches. Router aux loss values and every gradient (experts gathered from
    their owning rank) must match."""
    case = Case(ep=2, moe=True, overrides=router)
    mbs = per_replica_microbatches(4)
    ref = reference(workers, case, mbs)
    out = parallel(workers, case, [[mbs[0]], [mbs[1]]], ref["initial"])
    for r, res in enumerate(out):
        assert_close(res["logprobs"][0], ref["logprobs"][r], f"logprobs of micro-batch {r}")
        assert_close(res["loss_sums"][0], ref["loss_sums"][r], f"loss of micro-batch {r}")
    check_against_replicated(out, [[mbs[0]], [mbs[1]]], case)
    # per-layer load-balancing loss, accumulated over micro-batches: summed over the ranks
    summed = {k: out[0]["router_losses"][k] + out[1]["router_losses"][k] for k in out[0]["router_losses"]}
    check_router_losses(summed, ref["router_losses"], "summed over the 2 replicas", True)
    check_step(out, ref, "EP=2")


def test_tp2_x_ep2_equals_tp1_ep1(workers):
    """4 ranks, Qwen3-MoE style: TP=2 with sequence parallelism for attention, the 4 experts over
    EP=2 with expert TP=2 (the dispatcher gathers routed tokens over TP with uneven counts), and
    2 DP replicas for the dense weights, each with its own micro-batch."""
    case = Case(tp=2, ep=2, sequence_parallel=True, moe=True)
    mbs = per_replica_microbatches(4)
    ref = reference(workers, case, mbs)
    out = parallel(workers, case, [[mbs[0]], [mbs[1]]], ref["initial"])
    assert len(out) == 4
    for res in out:
        r = _dp_index(case, res["rank"])
        assert_close(res["logprobs"][0], ref["logprobs"][r], f"rank {res['rank']}: logprobs of micro-batch {r}")
        assert_close(res["loss_sums"][0], ref["loss_sums"][r], f"rank {res['rank']}: loss of micro-batch {r}")
    # router losses are TP-reduced on every rank: one rank per replica, summed
    summed = {k: out[0]["router_losses"][k] + out[2]["router_losses"][k] for k in out[0]["router_losses"]}
    check_router_losses(summed, ref["router_losses"], "summed over the 2 replicas", True)
    check_step(out, ref, "TP=2 x EP=2")


def test_dp2_grads_equal_single_rank_sum(workers):
    """Two DP replicas, each its own micro-batch; after Megatron's DDP all-reduce and
    finalize_model_grads (division by the all-reduced token count) the gradients equal the
    single-rank gradient of the global token-mean loss (sum over both micro-batches / N_0 + N_1),
    checked two ways: against one rank running both micro-batches, and against the token-count
    weighted sum of two single-micro-batch runs, N_k * grad_k / (N_0 + N_1)."""
    case = Case()
    mbs = per_replica_microbatches(1)
    ref = reference(workers, case, mbs)
    out = parallel(workers, case, [[mbs[0]], [mbs[1]]], ref["initial"])
    for r, res in enumerate(out):
        assert_close(res["loss_sums"][0], ref["loss_sums"][r], f"loss of micro-batch {r}")
    check_against_replicated(out, [[mbs[0]], [mbs[1]]], case)
    check_step(out, ref, "DP=2 vs one rank with both micro-batches")

    # Independent of Megatron's multi-micro-batch accumulation: each micro-batch alone (its loss
    # normalised by its own count N_k), recombined with the global normalisation by hand.
    n = [mb["layout"].num_edges for mb in mbs]
    alone = [reference_grads(reference(workers, case, [mb], weights=ref["initial"])) for mb in mbs]
    expected = {k: (n[0] * alone[0][k] + n[1] * alone[1][k]) / (n[0] + n[1]) for k in alone[0]}
    got = gather_full_grads(out)
    assert_grads_equal(got, expected, "DP=2 vs sum_k N_k grad_k / N")
    # ... and the test can tell: the mean of per-replica token means is far from it
    per_rank_mean = {k: (alone[0][k] + alone[1][k]) / 2 for k in alone[0]}
    gap = max(((got[k] - g).abs().max() / g.abs().max()).item() for k, g in per_rank_mean.items())
    assert gap > 100 * RTOL, f"a mean of per-replica means differs by only {gap:.1e}: micro-batches too alike"


def test_dp2_with_gradient_accumulation_equals_one_rank_with_all_micro_batches(workers):
    """Each DP replica accumulates two micro-batches (Megatron sums their token counts, then
    all-reduces them over DP): equal to one rank running all four, MoE included."""
    case = Case(moe=True)
    mbs = [make_microbatch(seed=40 + k, pad_to_multiple=1, num_groups=3 - k % 2) for k in range(4)]
    ref = reference(workers, case, mbs)
    out = parallel(workers, case, [mbs[:2], mbs[2:]], ref["initial"])
    for r, res in enumerate(out):
        for k in range(2):
            assert_close(res["logprobs"][k], ref["logprobs"][2 * r + k], f"replica {r} micro-batch {k}: logprobs")
            assert_close(res["loss_sums"][k], ref["loss_sums"][2 * r + k], f"replica {r} micro-batch {k}: loss")
    check_against_replicated(out, [mbs[:2], mbs[2:]], case)
    summed = {k: out[0]["router_losses"][k] + out[1]["router_losses"][k] for k in out[0]["router_losses"]}
    check_router_losses(summed, ref["router_losses"], "summed over the 2 replicas", True)
    check_step(out, ref, "DP=2 x 2 micro-batches")


# ------------------------------------------------------------------------------------------------
# The harness itself: a wrong shard is caught, a failing or hanging rank fails the test
# (last in the file: the launcher tests kill the workers)
# ------------------------------------------------------------------------------------------------


def test_a_wrong_tp_shard_would_fail(workers):
    """Negative control: split the SwiGLU fc1 weight [gate; up] as one block (rank 0 gets only
    gate rows, rank 1 only up rows) and the TP=2 logprobs no longer match TP=1."""
    case = Case(tp=2)
    mbs = [make_microbatch(seed=10, pad_to_multiple=2)]
    ref = reference(workers, case, mbs)
    wrong = dict(ref["initial"])
    for name, w in ref["initial"].items():
        if name.endswith("linear_fc1.weight"):
            gate, up = w.chunk(2, 0)
            # what take_shard(gated=True) would produce for this weight, if it were gated=False
            wrong[name] = torch.cat([torch.cat([gate.chunk(2, 0)[0], up.chunk(2, 0)[0]]),
                                     torch.cat([gate.chunk(2, 0)[1], up.chunk(2, 0)[1]])])
    out = parallel(workers, case, [mbs], wrong)
    diff = (out[0]["logprobs"][0] - ref["logprobs"][0]).abs().max()
    assert diff > 100 * RTOL * ref["logprobs"][0].abs().max(), f"a wrong shard changed logprobs by only {diff:.3e}"


def _fail_on_rank_1():
    import torch.distributed as dist

    assert dist.get_rank() != 1, "deliberate failure on rank 1"
    dist.barrier()  # rank 0 would wait here forever without the launcher's handling


def _hang_on_rank_0():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def _rank():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_launcher_reports_a_failing_rank_with_its_traceback(workers):
    # rank 0 fails too (its barrier loses rank 1); the root cause must be in the message
    with pytest.raises(AssertionError, match=r"(?s)rank\(s\) \[(0, )?1\].*--- rank 1 ---.*deliberate failure on rank 1"):
        workers.run(_fail_on_rank_1, world_size=2)
    assert workers.run(_rank, world_size=2) == [(0, 2), (1, 2)], "workers restart after a failure"


def test_launcher_times_out_on_a_hang(workers):
    assert workers.run(_rank, world_size=2) == [(0, 2), (1, 2)]  # warm: the next task starts at once
    # rank 1 returns at once; on a loaded machine it may still be running when rank 0 times out
    with pytest.raises(TimeoutError, match=r"_hang_on_rank_0: ranks \[0(, 1)?\] did not finish within 5s"):
        workers.run(_hang_on_rank_0, timeout_s=5, world_size=2)
