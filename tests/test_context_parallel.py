"""Context parallelism: CP=2 (and CP=2 x TP=2) equals CP=1; the partition balances attention work.

Model runs go through Megatron's training path as in tests/test_distributed.py (DDP over DP x CP,
forward_backward_no_pipelining with per-token loss, finalize_model_grads) on spawned gloo ranks;
the reference is CP=1 on one rank with the same weights. Compared: the logprobs of every loss
edge, the GRPO loss, the MoE router losses and every parameter gradient. The micro-batches are
chosen so that a prompt's last row (which predicts the first token of each of its responses)
lives on another CP rank than some of those responses; each test asserts that it does.
"""

from __future__ import annotations

import pytest
import torch

from megatron_cpu import GlooWorkers
from test_distributed import (
    assert_close,
    assert_grads_equal,
    gather_full_grads,
    grpo_loss_sum,
    rank_placements,
    recorded_router_losses,
)

from megatron_dualkv.checkpoint.sharding import take_shard
from megatron_dualkv.cp import cp_partition, key_counts
from megatron_dualkv.layout import Group, build_layout
from megatron_dualkv.ops import dualkv_attention, flex_backend
from megatron_dualkv.ops.reference import allowed_mask, reference_attention

VOCAB = 256
CHUNKS_PER_RANK = 2

# ------------------------------------------------------------------------------------------------
# Partition (no model)
# ------------------------------------------------------------------------------------------------


def grpo_layout(groups_spec, seed=0, **kw):
    """groups_spec: [(P, [R_1, ...]), ...] -> PackedLayout of random ids."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g)
    return build_layout([Group.of(ids(p), [ids(r) for r in rs]) for p, rs in groups_spec], **kw)


def test_key_counts_match_the_mask():
    layout = grpo_layout([(5, [3, 1, 4]), (3, [2, 5])], pad_to_multiple=8)
    rows = torch.arange(layout.num_tokens)
    want = allowed_mask(layout.segments, rows, rows).sum(1)
    assert torch.equal(key_counts(layout.segments), want)


def test_partition_covers_every_row_once_and_edges_by_source():
    layout = grpo_layout([(9, [3, 1, 4]), (7, [2, 6]), (3, [5])])
    part = cp_partition(layout, 3, chunks_per_rank=2, chunk_multiple=2)
    shards = [part.shard(r) for r in range(3)]
    rows = torch.cat([s.rows for s in shards])
    assert torch.equal(rows.sort().values, torch.arange(part.layout.num_tokens))
    assert all(s.num_local == part.num_local and s.num_local % 2 == 0 for s in shards)
    edges = torch.cat([s.edges for s in shards])
    assert torch.equal(edges.sort().values, torch.arange(layout.num_edges))
    for s in shards:  # an edge is computed where its source row lives
        assert torch.equal(s.rows[s.edge_source], layout.source_rows[s.edges])
    # CP padding: one root segment after the layout, no edges, weight 0, marked padding
    pad = part.layout.num_tokens - layout.num_tokens
    assert pad > 0 and part.layout.segments.host_parent[-1] == -1
    assert part.layout.padding_mask[layout.num_tokens:].all() and (part.layout.token_weight[layout.num_tokens:] == 0).all()
    assert part.layout.num_edges == layout.num_edges


REALISTIC = {
    "N16-P32K-R2K": [(32768, [2048] * 16)],
    "4 groups mixed": [(16384, [1024] * 8), (8192, [2048] * 4), (4096, [512] * 16), (12000, [3000, 100, 1500])],
    "short prompt long responses": [(1024, [8192] * 8)],
}


@pytest.mark.parametrize("name", list(REALISTIC))
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_partition_balances_attention_work(name, cp):
    """Stated bound: every rank's attention work (attended pairs) is within 2% of the mean, for
    at least 8 chunks per rank of 128-multiple rows, with at most 3% CP padding rows; and the
    proven bound max - min <= spread_bound holds.
    Token-count splitting (zigzag over 2cp equal chunks, Megatron's default) is far off on the
    same shapes: the cost-balanced partition must beat it."""
    layout = grpo_layout(REALISTIC[name])
    part = cp_partition(layout, cp, chunks_per_rank=8, chunk_multiple=128)
    costs = part.rank_cost
    assert sum(costs) == int(key_counts(part.layout.segments).sum())
    assert max(costs) - min(costs) <= part.spread_bound
    assert part.imbalance <= 1.02, (name, cp, part.imbalance)
    assert part.layout.num_tokens - layout.num_tokens <= 0.03 * layout.num_tokens  # CP padding
    assert part.chunks_per_rank >= 8
    # Megatron's zigzag split of the same padded rows
    keys = key_counts(part.layout.segments)
    halves = keys.reshape(2 * cp, -1).sum(1)
    zigzag = [int(halves[r] + halves[2 * cp - 1 - r]) for r in range(cp)]
    zigzag_imbalance = max(zigzag) * cp / sum(zigzag)
    assert part.imbalance <= zigzag_imbalance


def test_partition_refuses_bad_sizes():
    layout = grpo_layout([(4, [2])])
    with pytest.raises(ValueError, match="must be >= 1"):
        cp_partition(layout, 0)


# ------------------------------------------------------------------------------------------------
# Backends take local queries with global rows
# ------------------------------------------------------------------------------------------------


def _local_rows_case():
    layout = grpo_layout([(37, [5, 1, 60]), (130, [1, 90]), (3, [7])], pad_to_multiple=4)
    part = cp_partition(layout, 2, chunks_per_rank=3, chunk_multiple=16)
    g = torch.Generator().manual_seed(5)
    t = part.layout.num_tokens
    q = torch.randn(t, 4, 16, dtype=torch.float64, generator=g)
    k = torch.randn(t, 2, 16, dtype=torch.float64, generator=g)
    v = torch.randn(t, 2, 16, dtype=torch.float64, generator=g)
    return part, q, k, v


def test_reference_local_queries_equal_full_attention():
    part, q, k, v = _local_rows_case()
    seg = part.layout.segments
    ref, ref_lse = reference_attention(q, k, v, seg, 0.3)
    for r in range(2):
        rows = part.shard(r).rows
        out, lse = reference_attention(q[rows], k, v, seg, 0.3, query_chunk=17, q_rows=rows)
        assert (out - ref[rows]).abs().max() < 1e-12 and (lse - ref_lse[:, rows]).abs().max() < 1e-12
        out = dualkv_attention(q[rows], k, v, part.layout, 0.3, backend="reference", q_rows=rows)
        assert (out - ref[rows]).abs().max() < 1e-12


@pytest.mark.skipif(flex_backend.flex_attention is None, reason="torch without FlexAttention")
def test_flex_local_block_mask_and_eager_attention():
    """Block classes for local query rows equal the dense mask of those rows; eager flex with
    q_rows equals the reference rows (mask_mod with the global row lookup)."""
    part, q, k, v = _local_rows_case()
    seg = part.layout.segments
    block = 16
    cols = torch.arange(seg.num_tokens)
    for r in range(2):
        rows = part.shard(r).rows
        full, partial = flex_backend.block_classes(seg, block, block, rows)
        dense = allowed_mask(seg, rows, cols)
        n_q, n_kv = -(-rows.numel() // block), -(-seg.num_tokens // block)
        for i in range(n_q):
            for j in range(n_kv):
                tile = dense[i * block:(i + 1) * block, j * block:(j + 1) * block]
                assert bool(full[i, j]) == bool(tile.all()), (r, i, j)
                assert bool(partial[i, j]) == (bool(tile.any()) and not bool(tile.all())), (r, i, j)
    ref, _ = reference_attention(q, k, v, seg, 0.3)
    rows = part.shard(1).rows[3:]  # not a whole number of 128-row blocks: exercises the q padding
    out = flex_backend.attention(q[rows], k, v, seg, 0.3, compiled=False, q_rows=rows)
    assert (out - ref[rows]).abs().max() < 1e-12


def cp_attention_worker(kind: str) -> dict:
    """One rank's attention output and input gradients (of a fixed random loss) under CP=2."""
    import torch.distributed as dist

    from megatron_dualkv.cp import cp_dualkv_attention, ulysses_dualkv_attention

    part, q, k, v = _local_rows_case()
    shard = part.shard(dist.get_rank())
    rows = shard.rows
    ql, kl, vl = (x[rows].clone().requires_grad_() for x in (q, k, v))
    attend = ulysses_dualkv_attention if kind == "a2a" else cp_dualkv_attention
    out = attend(ql, kl, vl, shard, dist.group.WORLD, 0.3, "reference")
    weight = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(9))[rows]
    (out * weight).sum().backward()
    return {"rows": rows, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


@pytest.mark.parametrize("kind", ["all_gather", "a2a"])
def test_cp_attention_forward_and_backward_equal_full(workers, kind):
    """Two gloo ranks: each rank's output rows and its rows' dQ, dK, dV (K/V gradients reduced back
    from every rank's queries) equal the full reference attention's."""
    part, q, k, v = _local_rows_case()
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(q, k, v, part.layout.segments, 0.3)
    weight = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(9))
    (ref * weight).sum().backward()
    for res in workers.run(cp_attention_worker, kind, world_size=2):
        rows = res["rows"]
        for name, got, want in (("out", res["out"], ref.detach()), ("dq", res["dq"], q.grad),
                                ("dk", res["dk"], k.grad), ("dv", res["dv"], v.grad)):
            assert (got - want[rows]).abs().max() < 1e-12, (kind, name)


def dense_kv_worker() -> bool:
    """cp_dualkv_attention on one rank, recording whether the entry point got dense K and V."""
    import torch.distributed as dist

    from megatron_dualkv.cp import attention as cp_attention

    part, q, k, v = _local_rows_case()
    shard = part.shard(dist.get_rank())
    seen = []
    entry = cp_attention.dualkv_attention

    def recording(q_, k_, v_, *args, **kwargs):
        seen.append(k_.is_contiguous() and v_.is_contiguous())
        return entry(q_, k_, v_, *args, **kwargs)

    cp_attention.dualkv_attention = recording
    try:
        rows = shard.rows
        cp_attention.cp_dualkv_attention(q[rows], k[rows], v[rows], shard, dist.group.WORLD, 0.3, "reference")
    finally:
        cp_attention.dualkv_attention = entry
    return seen == [True]


def test_cp_attention_hands_dense_kv_to_the_entry_point(workers):
    """The gathered K/V reach the attention backends as dense tensors: the CUDA kernels refuse
    strided views ("k is not contiguous"), which slicing the one gathered [T, 2 Hkv, D] tensor gives."""
    assert all(workers.run(dense_kv_worker, world_size=2))


@pytest.mark.skipif(not torch.cuda.is_available() or flex_backend.flex_attention is None, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_local_queries_on_gpu(dtype):
    """GPU: the compiled FlexAttention kernel with q_rows (local block mask, padded q blocks) gives
    each rank's rows of out, dQ and (summed over ranks) dK, dV as the float64 reference; bf16
    within 3x the error of the non-local flex call on the same inputs."""
    layout = grpo_layout([(700, [130, 1, 260]), (300, [90, 45])], pad_to_multiple=4)
    part = cp_partition(layout, 2, chunks_per_rank=3, chunk_multiple=128)
    seg = part.layout.segments.to("cuda")
    t, scale = seg.num_tokens, 0.09
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(t, h, 128, device="cuda", generator=g).to(dtype) for h in (8, 2, 2))
    dout = torch.randn(t, 8, 128, device="cuda", generator=g).to(dtype)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, seg, scale)
    truth = (ref.detach(), *torch.autograd.grad(ref, (q64, k64, v64), dout.double()))
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    full = flex_backend.attention(qf, kf, vf, seg, scale)
    base = (full.detach(), *torch.autograd.grad(full, (qf, kf, vf), dout))
    got = [torch.zeros_like(x, dtype=torch.float64) for x in truth]
    for r in range(2):
        rows = part.shard(r).rows.cuda()
        ql, kk, vv = q[rows].clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()
        out = flex_backend.attention(ql, kk, vv, seg, scale, q_rows=rows)
        dq, dk, dv = torch.autograd.grad(out, (ql, kk, vv), dout[rows])
        got[0][rows], got[1][rows] = out.double(), dq.double()
        got[2] += dk.double()
        got[3] += dv.double()
    rel = lambda a, b: float((a.double() - b).abs().max() / b.abs().max())
    for name, x, b, tr in zip(("out", "dq", "dk", "dv"), got, base, truth):
        if dtype == torch.float32:
            assert rel(x, tr) < 1e-4, (name, rel(x, tr))
        else:
            assert rel(x, tr) <= 3 * rel(b, tr) + 1e-3, (name, rel(x, tr), rel(b, tr))


def test_ulysses_refuses_heads_that_do_not_split():
    from megatron_dualkv.cp import ulysses_problem

    assert ulysses_problem(32, 8, 4) == ""
    assert "multiples of 2" in ulysses_problem(2, 1, 2)


def test_cuda_backend_local_queries_need_the_ws_kernels(monkeypatch):
    """The CUDA backend takes local queries on its ws kernels only: with another kernel forced by
    the environment (or an extension without ws ops) the entry point skips it with that reason."""
    from megatron_dualkv.ops import cuda_backend
    from megatron_dualkv.ops.attention import backend_status

    ok, why = backend_status("cuda", torch.empty(4, 2, 64), local_queries=True)
    assert not ok and why  # no GPU / extension here: skipped with a reason
    monkeypatch.setattr(cuda_backend, "_load", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "_has_op", lambda name: True)
    assert cuda_backend.supports_q_rows() == (True, "")
    monkeypatch.setenv("MEGATRON_DUALKV_CUDA_BWD", "sm90")
    ok, why = cuda_backend.supports_q_rows()
    assert not ok and "ws kernels only" in why
    monkeypatch.delenv("MEGATRON_DUALKV_CUDA_BWD")
    monkeypatch.setattr(cuda_backend, "_has_op", lambda name: name != "bwd_ws_sm90")
    ok, why = cuda_backend.supports_q_rows()
    assert not ok and "predates" in why


def test_deterministic_local_queries_take_the_ws_dq_kernel(monkeypatch):
    """Local queries run on the cuda kernel in both modes (deterministic: its ws dQ kernel).
    With MEGATRON_DUALKV_DQ_KERNEL=sm90, which takes all query rows only, the entry point skips
    the cuda kernel for deterministic local queries with that reason (and takes the next backend),
    while fast mode and deterministic calls without local queries keep it."""
    from megatron_dualkv.ops import cuda_backend
    from megatron_dualkv.ops.attention import select_backend

    monkeypatch.setattr(cuda_backend, "_load", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "_has_op", lambda name: True)
    monkeypatch.setattr(cuda_backend, "is_available", lambda q=None: (True, ""))
    q = torch.empty(4, 2, 64)
    assert select_backend(q, local_queries=True) == ("cuda", "fastest available")
    assert select_backend(q, local_queries=True, deterministic=True) == ("cuda", "fastest available")
    monkeypatch.setenv("MEGATRON_DUALKV_DQ_KERNEL", "sm90")
    assert select_backend(q, local_queries=True) == ("cuda", "fastest available")
    assert select_backend(q, local_queries=False, deterministic=True) == ("cuda", "fastest available")
    name, why = select_backend(q, local_queries=True, deterministic=True)
    assert name != "cuda" and "cuda: local queries run on the ws dQ kernel only" in why
    with pytest.raises(RuntimeError, match="MEGATRON_DUALKV_DQ_KERNEL=sm90 takes all rows"):
        select_backend(q, "cuda", local_queries=True, deterministic=True)


# ------------------------------------------------------------------------------------------------
# Megatron: one training step per configuration (runs inside the gloo workers)
# ------------------------------------------------------------------------------------------------


def make_microbatch(seed: int, spec) -> dict:
    g = torch.Generator().manual_seed(seed)
    layout = grpo_layout(spec, seed=seed, vocab_size=VOCAB)
    return {
        "layout": layout,
        "advantages": torch.randn(layout.num_responses, generator=g),
        "ref_logprobs": -5.5 + 0.5 * torch.randn(layout.num_edges, generator=g),
    }


# Several groups per micro-batch; the third micro-batch leaves one CP rank with prompt rows only
# (no loss edge to compute: its logprobs are all gathered from the other rank).
SPECS = [[(13, [4, 1, 6]), (5, [3, 7])], [(6, [2, 9]), (11, [5, 3, 1])], [(48, [1, 1])]]


def cp_train_step(moe: bool, cp: int, tp: int, sp: bool, overrides: tuple, replicas: list, weights,
                  chunk_multiple: int, ep: int = 1) -> dict:
    """One training step; `replicas[d]` are the micro-batches of data-parallel replica d."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_cpu import model_parallel
    from megatron_dualkv.cp import cp_shard
    from megatron_dualkv.megatron import build_dualkv_model, cp_token_count, qwen3_config

    from megatron.core import parallel_state

    global_num_tokens = float(sum(mb["layout"].num_edges for mbs in replicas for mb in mbs))
    with model_parallel(tp=tp, ep=ep, cp=cp) as pgs:
        mbs = replicas[parallel_state.get_data_parallel_rank()]
        cfg = qwen3_config(
            "tiny-moe" if moe else "tiny", **dict(overrides), vocab_size=VOCAB, use_cpu_initialization=True,
            params_dtype=torch.float32, tensor_model_parallel_size=tp, context_parallel_size=cp,
            expert_model_parallel_size=ep,
            sequence_parallel=sp, calculate_per_token_loss=True, finalize_model_grads_func=finalize_model_grads,
        )
        model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False,
                                   cp_chunks_per_rank=CHUNKS_PER_RANK, cp_chunk_multiple=chunk_multiple)
        shards = rank_placements(model, pgs)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if weights is not None:
                    p.copy_(take_shard(weights[shards[n].full_name], shards[n]))
                elif "layernorm" in n:
                    p.add_(0.1 * torch.randn_like(p))
        initial = {shards[n].full_name: p.detach().clone() for n, p in model.named_parameters()}
        ddp = DistributedDataParallel(cfg.transformer, DistributedDataParallelConfig(use_distributed_optimizer=False),
                                      model, pg_collection=pgs)
        ddp.zero_grad_buffer()
        get_moe_metrics_tracker().clear()
        logprobs, loss_sums, split = [], [], []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            layout = mb["layout"]
            if cp > 1:  # record where the last prompt rows landed (the test asserts a split)
                shard = cp_shard(layout, pgs.cp.rank(), cp, CHUNKS_PER_RANK, chunk_multiple)
                split.append((shard.rows.tolist(), shard.edges.tolist()))
            lp = model(layout=layout).logprobs
            logprobs.append(lp.detach().clone())

            def loss_func(lp):
                loss_sum = grpo_loss_sum(lp, mb, global_num_tokens)
                loss_sums.append(loss_sum.detach().clone())
                count = cp_token_count(torch.tensor(layout.num_edges, dtype=torch.int), pgs.cp)
                return loss_sum, count, {"loss": loss_sum.detach()}

            return lp, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp], num_microbatches=len(mbs),
            seq_length=0, micro_batch_size=1, forward_only=False, pg_collection=pgs,
        )
        grads = {n: (shards[n], p.main_grad.detach().clone()) for n, p in model.named_parameters()}
        return {"rank": dist.get_rank(), "initial": initial, "grads": grads, "logprobs": logprobs,
                "loss_sums": loss_sums, "router_losses": recorded_router_losses(), "split": split}


@pytest.fixture(scope="module")
def workers():
    with GlooWorkers(4, timeout_s=240) as w:
        yield w


SEQ_AUX_AND_Z = (("moe_router_load_balancing_type", "seq_aux_loss"), ("moe_z_loss_coeff", 1e-3))


def prompt_rows_split(results: list, mbs: list) -> bool:
    """Some group's last prompt row is computed on one CP rank while one of its responses'
    rows lives on another (the edge-on-source-rank rule is exercised)."""
    for k, mb in enumerate(mbs):
        layout = mb["layout"]
        owner = {}
        for res in results:
            rows, _ = res["split"][k]
            for row in rows:
                owner.setdefault(row, res["rank"])
        for g, prompt_seg in enumerate(layout.group_prompt_segment):
            last = layout.segments.host_start[prompt_seg] + layout.segments.host_length[prompt_seg] - 1
            for s in layout.group_response_segments[g]:
                if owner[layout.segments.host_start[s]] != owner[last]:
                    return True
    return False


def run_and_compare(workers, moe: bool, cp: int, tp: int, sp: bool, overrides: tuple = (), ep: int = 1, dp: int = 1):
    """CP (x TP x EP) step vs CP=1 on one rank holding every micro-batch. With dp > 1 the
    micro-batches are dealt round-robin to the DP replicas (different token counts per replica)."""
    mbs = [make_microbatch(40 + i, spec) for i, spec in enumerate(SPECS)]
    replicas = [mbs[d::dp] for d in range(dp)]
    chunk_multiple = 2 * tp
    ref = workers.run(cp_train_step, moe, 1, 1, False, overrides, [mbs], None, chunk_multiple, world_size=1)[0]
    out = workers.run(cp_train_step, moe, cp, tp, sp, overrides, replicas, ref["initial"], chunk_multiple, ep,
                      world_size=cp * tp * dp)
    ref_index = {id(mb): k for k, mb in enumerate(mbs)}
    for res in out:  # rank = tp-rank + tp * (cp-rank + cp * dp-replica) (Megatron's tp-cp-ep-dp order)
        res["mbs"] = [ref_index[id(mb)] for mb in replicas[res["rank"] // (tp * cp)]]
    split = no_edges = False
    for d in range(dp):
        cp_ranks = [r for r in out if r["rank"] % tp == 0 and r["rank"] // (tp * cp) == d]
        split = split or prompt_rows_split(cp_ranks, replicas[d])
        no_edges = no_edges or any(len(r["split"][k][1]) == 0 for r in cp_ranks for k in range(len(replicas[d])))
    assert split, "no group has its last prompt row on another rank than a response: the test lost its point"
    assert no_edges, "no CP rank without loss edges"
    what = f"CP={cp} TP={tp} EP={ep} sp={sp} moe={moe} {dict(overrides)}"
    for res in out:
        for i, k in enumerate(res["mbs"]):
            assert_close(res["logprobs"][i], ref["logprobs"][k], f"{what}: logprobs of micro-batch {k} on rank {res['rank']}")
            assert_close(res["loss_sums"][i], ref["loss_sums"][k], f"{what}: loss of micro-batch {k} on rank {res['rank']}")
        assert set(res["router_losses"]) == set(ref["router_losses"])
        for name, want in ref["router_losses"].items():
            assert (want != 0).all()
            assert_close(res["router_losses"][name], want, f"{what}: router {name}")
    assert_grads_equal(gather_full_grads(out), {n: g for n, (s, g) in ref["grads"].items()}, what)


A2A = (("cp_comm_type", "a2a"),)


@pytest.mark.parametrize("moe,overrides", [(False, ()), (True, ()), (True, SEQ_AUX_AND_Z), (False, A2A), (True, A2A)],
                         ids=["dense", "moe-aux", "moe-seqaux-z", "dense-a2a", "moe-a2a"])
def test_cp2_equals_cp1(workers, moe, overrides):
    """K/V all-gather (default) and all-to-all (Ulysses, heads split over CP) variants."""
    run_and_compare(workers, moe, cp=2, tp=1, sp=False, overrides=overrides)


def test_cp2_tp2_sequence_parallel_equals_cp1(workers):
    """4 ranks: CP=2 x TP=2 with sequence parallelism, MoE (Megatron refuses MoE + TP without SP)."""
    run_and_compare(workers, True, cp=2, tp=2, sp=True)


def test_gpu_cp_check_tool_runs_tiny_on_cpu(tmp_path):
    """tools/gpu_cp_check.py --tiny: the 2-GPU script's whole path on 2 CPU ranks (gloo)."""
    import json
    import os
    import subprocess
    import sys

    from megatron_cpu import free_port

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "cp_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         os.path.join(repo, "tools", "gpu_cp_check.py"), "--tiny", "--out", str(out)],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    for comm in ("all_gather", "a2a"):
        check = summary["exactness_float32"][f"cp2_{comm}"]
        assert check["passed"] and check["grad_rel_max"] <= 1e-4, check
    cost = summary["cost_bf16"]
    assert len(cost["per_rank"]) == 2 and cost["attention_imbalance_cp2"] >= 1.0


def test_cp2_ep2_equals_cp1(workers):
    """2 ranks: CP=2 with the 4 experts split over the same 2 ranks (EP=2, alltoall dispatcher):
    each rank routes its own rows' tokens to experts on both ranks."""
    run_and_compare(workers, True, cp=2, tp=1, sp=False, ep=2)


def test_dp2_cp2_equals_one_rank(workers):
    """4 ranks: 2 data-parallel replicas, each split over 2 CP ranks, different micro-batches per
    replica: gradients reduced over DP x CP and divided by the token count summed over DP x CP
    (each micro-batch counted once, on its CP rank 0) equal one rank holding every micro-batch."""
    run_and_compare(workers, False, cp=2, tp=1, sp=False, dp=2)
