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

import re
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

from megatron_cpu import GlooWorkers

VOCAB = 256
HIDDEN = 64
HEADS = 4
QUERY_GROUPS = 2
KV_CHANNELS = 16
FFN = 128
LAYERS = 2
EXPERTS = 4
TOPK = 2

# float32 with reductions reordered by the parallel split: agreement to ~1e-6 relative.
RTOL = 2e-5


@dataclass(frozen=True)
class Case:
    """One parallel configuration of the tiny model."""

    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    moe: bool = False

    @property
    def world_size(self) -> int:
        return max(self.tp, self.ep)


# ------------------------------------------------------------------------------------------------
# Micro-batches (host data only: these cross the process boundary)
# ------------------------------------------------------------------------------------------------


def make_groups(seed: int, num_groups: int = 3) -> list:
    """Several GRPO groups with different prompt lengths and response lengths (one of length 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()
    groups = [
        (ids(5), [ids(3), ids(1), ids(4)]),
        (ids(3), [ids(2), ids(5)]),
        (ids(4), [ids(3)]),
    ]
    return groups[:num_groups]


def make_microbatch(seed: int, pad_to_multiple: int = 1, num_groups: int = 3) -> dict:
    from megatron_dualkv.layout import build_layout

    layout = build_layout(make_groups(seed, num_groups), vocab_size=VOCAB, pad_to_multiple=pad_to_multiple)
    g = torch.Generator().manual_seed(seed + 1)
    # per-edge weights stand in for advantages: every edge reaches the gradient differently
    edge_weight = torch.randn(layout.num_edges, generator=g)
    return {"layout": layout, "edge_weight": edge_weight}


# ------------------------------------------------------------------------------------------------
# The model under test (runs inside the workers)
# ------------------------------------------------------------------------------------------------


def tiny_config(case: Case):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    moe = dict(
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss", moe_grouped_gemm=False,
    ) if case.moe else {}
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=QUERY_GROUPS, kv_channels=KV_CHANNELS, ffn_hidden_size=FFN,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=case.tp, expert_model_parallel_size=case.ep,
        sequence_parallel=case.sequence_parallel,
        calculate_per_token_loss=True, finalize_model_grads_func=finalize_model_grads,
        **moe,
    )


def build_model(config, pgs):
    """Stock GPTModel, local spec (stand-in until the DualKV model lands)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True,
        normalization="RMSNorm",
    )
    return GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=256, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, pg_collection=pgs,
    )


def dense_mask(layout) -> torch.Tensor:
    """[1, 1, T, T] bool, True where attention is NOT allowed: the DualKV visibility rule as a
    dense mask, so that the stock attention computes what DualKV attention computes."""
    seg = layout.segments
    seg_of = seg.token_segment_ids().tolist()
    allowed = torch.zeros(seg.num_tokens, seg.num_tokens, dtype=torch.bool)
    for i in range(seg.num_tokens):
        visible = set(seg.ancestors(seg_of[i]))
        for j in range(i + 1):
            if seg_of[j] in visible or seg_of[j] == seg_of[i]:
                allowed[i, j] = True
    return (~allowed)[None, None]


def edge_logprobs(model, mb: dict) -> torch.Tensor:
    """Per-edge logprobs [E] of the packed micro-batch.

    Stand-in: the stock GPTModel returns vocab-parallel cross entropy of every row against
    `labels`; a shared last-prompt row predicts several first tokens, so the model runs once per
    'edge rank' k (the k-th edge of each source row) and picks its edges out."""
    layout = mb["layout"]
    ids = layout.input_ids[None]
    mask = dense_mask(layout)
    out = torch.empty(layout.num_edges)
    pending = torch.arange(layout.num_edges)
    src, tgt = layout.source_rows, layout.target_ids
    while pending.numel():
        rows = src[pending]
        first = torch.ones_like(pending, dtype=torch.bool)
        seen = set()
        for n, r in enumerate(rows.tolist()):
            first[n] = r not in seen
            seen.add(r)
        now = pending[first]
        labels = torch.zeros(layout.num_tokens, dtype=torch.long)
        labels[src[now]] = tgt[now]
        nll = model(ids, None, mask, labels=labels[None])  # [1, T]
        out = out.index_put((now,), -nll[0, src[now]])
        pending = pending[~first]
    return out


# ------------------------------------------------------------------------------------------------
# Sharding: full (TP=1, EP=1) parameter names and tensors <-> this rank's shards
# ------------------------------------------------------------------------------------------------

_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Shard:
    """Where a local parameter sits in the full one."""

    full_name: str
    dim: Optional[int]  # partition dim, None if replicated over the parameter's TP group
    rank: int  # rank in the parameter's TP group
    size: int  # size of the parameter's TP group
    gated: bool  # swiglu fc1: [gate; up] each split separately


def shard_of(name: str, param, config, pgs) -> Shard:
    from megatron.core import parallel_state as ps

    is_expert = not getattr(param, "allreduce", True)
    full_name = name
    if is_expert:
        m = _LOCAL_EXPERT.search(name)
        if m is None:
            raise AssertionError(f"expert parameter {name} is not a SequentialMLP local expert")
        per_rank = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        global_index = ps.get_expert_model_parallel_rank() * per_rank + int(m.group(1))
        full_name = _LOCAL_EXPERT.sub(f"local_experts.{global_index}.", name)
        rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    else:
        rank, size = pgs.tp.rank(), pgs.tp.size()
    split = getattr(param, "tensor_model_parallel", False) and size > 1
    return Shard(
        full_name=full_name,
        dim=param.partition_dim if split else None,
        rank=rank,
        size=size,
        gated=split and config.gated_linear_unit and name.endswith("linear_fc1.weight"),
    )


def take_shard(full: torch.Tensor, s: Shard) -> torch.Tensor:
    if s.dim is None:
        return full
    if s.gated:
        return torch.cat([half.chunk(s.size, s.dim)[s.rank] for half in full.chunk(2, s.dim)], s.dim)
    return full.chunk(s.size, s.dim)[s.rank]


def join_shards(parts: list[torch.Tensor], s: Shard) -> torch.Tensor:
    """Inverse of take_shard; parts in TP-rank order."""
    if s.dim is None:
        return parts[0]
    if s.gated:
        halves = [p.chunk(2, s.dim) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], s.dim), torch.cat([h[1] for h in halves], s.dim)], s.dim)
    return torch.cat(parts, s.dim)


# ------------------------------------------------------------------------------------------------
# One training step on one rank (runs inside the workers)
# ------------------------------------------------------------------------------------------------


def train_step(case: Case, microbatches_per_rank: list, full_weights: Optional[dict]) -> dict:
    """Build the model for `case`, load `full_weights` (sharded for this rank; None: keep the
    seeded initialisation), run one forward/backward over this rank's micro-batches through
    Megatron's schedule, DDP and finalize_model_grads, and return what the test compares."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_cpu import model_parallel

    rank = dist.get_rank()
    with model_parallel(tp=case.tp, ep=case.ep) as pgs:
        config = tiny_config(case)
        model = build_model(config, pgs)
        shards = {n: shard_of(n, p, config, pgs) for n, p in model.named_parameters()}
        if full_weights is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(take_shard(full_weights[shards[n].full_name], shards[n]))
        initial = {shards[n].full_name: p.detach().clone() for n, p in model.named_parameters()}

        ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
            model,
            pg_collection=pgs,
        )
        ddp.zero_grad_buffer()
        get_moe_metrics_tracker().clear()

        mbs = microbatches_per_rank[_dp_index(case, rank)]
        logprobs, loss_sums = [], []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            lp = edge_logprobs(model, mb)
            logprobs.append(lp.detach())

            def loss_func(lp):
                loss_sum = -(lp * mb["edge_weight"]).sum()
                loss_sums.append(loss_sum.detach())
                count = torch.tensor(lp.numel(), dtype=torch.int)
                return loss_sum, count, {"loss": loss_sum.detach()}

            return lp, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
            num_microbatches=len(mbs), seq_length=0, micro_batch_size=1, forward_only=False,
            pg_collection=pgs,
        )
        grads = {
            n: (shards[n], p.main_grad.detach().clone())
            for n, p in model.named_parameters()
        }
        aux = get_moe_metrics_tracker().metrics.get("load_balancing_loss")
        return {
            "rank": rank,
            "initial": initial,
            "grads": grads,
            "logprobs": logprobs,
            "loss_sums": loss_sums,
            "aux_loss": None if aux is None else aux.values.detach().clone(),
        }


def _dp_index(case: Case, rank: int) -> int:
    """Which data-parallel replica this rank belongs to (tp is the innermost dimension)."""
    return rank // case.tp


# ------------------------------------------------------------------------------------------------
# Comparisons (pytest process)
# ------------------------------------------------------------------------------------------------


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """|actual - expected| <= rtol * max|expected| elementwise (scale-aware for near-zero entries)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3e} > {rtol:.0e} x max|expected| {scale:.3e}"


def gather_full_grads(results: list) -> dict:
    """Full gradients from every rank's shards; replicated shards must agree across ranks."""
    by_name: dict = {}
    for res in results:
        for local_name, (s, g) in res["grads"].items():
            by_name.setdefault(s.full_name, []).append((s, g, res["rank"]))
    full = {}
    for name, parts in by_name.items():
        s0 = parts[0][0]
        if s0.dim is None:
            for s, g, r in parts[1:]:
                assert_close(g, parts[0][1], f"grad {name}: rank {r} vs rank {parts[0][2]} (replicated)")
            full[name] = parts[0][1]
            continue
        by_rank: dict = {}
        for s, g, r in parts:
            if s.rank in by_rank:
                assert_close(g, by_rank[s.rank], f"grad {name}: rank {r} (replica of TP shard {s.rank})")
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
    with GlooWorkers(2, timeout_s=240) as w:
        yield w


def reference(workers, case: Case, microbatches: list) -> dict:
    """TP=1, EP=1, one rank holding every micro-batch; its seeded weights are the test's weights."""
    ref_case = replace(case, tp=1, ep=1, sequence_parallel=False)
    return workers.run(train_step, ref_case, [microbatches], None, world_size=1)[0]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_equals_tp1(workers, sequence_parallel):
    case = Case(tp=2, sequence_parallel=sequence_parallel)
    mbs = [make_microbatch(seed=10, pad_to_multiple=2)]
    ref = reference(workers, case, mbs)
    out = workers.run(train_step, case, [mbs], ref["initial"])
    for res in out:
        assert_close(res["logprobs"][0], ref["logprobs"][0], f"logprobs on rank {res['rank']}")
        assert_close(res["loss_sums"][0], ref["loss_sums"][0], f"loss on rank {res['rank']}")
    assert_grads_equal(gather_full_grads(out), {n: g for n, (s, g) in ref["grads"].items()}, "TP=2")


def _per_replica_microbatches(pad_to_multiple: int) -> list:
    """Two micro-batches of different token counts, one per data-parallel replica (a wrong
    normalisation, e.g. a mean of per-rank means, would then change the gradients)."""
    mbs = [make_microbatch(seed=20, pad_to_multiple=pad_to_multiple),
           make_microbatch(seed=30, pad_to_multiple=pad_to_multiple, num_groups=2)]
    assert mbs[0]["layout"].num_edges != mbs[1]["layout"].num_edges
    return mbs


def test_ep2_equals_ep1(workers):
    """MoE, experts split over 2 ranks (alltoall dispatcher); the two ranks are also DP replicas
    for the dense parameters, each with its own micro-batch. Reference: EP=1 on one rank holding
    both micro-batches. Router aux loss values and every gradient (experts gathered) must match."""
    case = Case(ep=2, moe=True)
    mbs = _per_replica_microbatches(1)
    ref = reference(workers, case, mbs)
    out = workers.run(train_step, case, [[mbs[0]], [mbs[1]]], ref["initial"])
    for r, res in enumerate(out):
        assert_close(res["logprobs"][0], ref["logprobs"][r], f"logprobs of micro-batch {r}")
        assert_close(res["loss_sums"][0], ref["loss_sums"][r], f"loss of micro-batch {r}")
    # per-layer load-balancing loss, accumulated over micro-batches: summed over the ranks
    assert ref["aux_loss"] is not None and (ref["aux_loss"] > 0).all()
    assert_close(out[0]["aux_loss"] + out[1]["aux_loss"], ref["aux_loss"], "router aux loss per layer")
    assert_grads_equal(gather_full_grads(out), {n: g for n, (s, g) in ref["grads"].items()}, "EP=2")


def test_dp2_grads_equal_single_rank_sum(workers):
    """Two DP replicas, each its own micro-batch; after Megatron's DDP all-reduce and
    finalize_model_grads (division by the all-reduced token count) the gradients equal one rank
    running both micro-batches, i.e. d/dθ [(loss_sum_0 + loss_sum_1) / (N_0 + N_1)]."""
    case = Case()
    mbs = _per_replica_microbatches(1)
    ref = reference(workers, case, mbs)
    out = workers.run(train_step, case, [[mbs[0]], [mbs[1]]], ref["initial"])
    for r, res in enumerate(out):
        assert_close(res["loss_sums"][0], ref["loss_sums"][r], f"loss of micro-batch {r}")
    assert_grads_equal(gather_full_grads(out), {k: g for k, (s, g) in ref["grads"].items()}, "DP=2")
