"""The memory/time planner (megatron_dualkv/planner.py) against Megatron on the CPU, and its arithmetic.

Measured here (tiny Qwen3 shapes, bf16, Megatron-Core local spec, CPU):
- parameter bytes, Megatron DDP's fp32 gradient buffer and the fp32 master + Adam state of
  Megatron's mixed-precision optimizer after one step: equal to the planner's, byte for byte;
- bytes saved for backward (saved_tensors_hooks, each storage once, parameters excluded), with the
  attention run as a flash-style autograd function (q, k, v, out, LSE saved; no T x T scores):
  within 1.5% of the planner's per-layer/per-token formula (no, selective and full recomputation),
  for DualKV and for the stock (replicated) batch with either loss path;
- the live-bytes peak of forward + backward (a dispatch mode tracking every storage an op
  creates until it is freed): within 15% of the planner's peak (saved + logits or backward
  transient).
- Megatron's own unfused DotProductAttention (what --no-dualkv runs without TE): saved bytes within
  1.5%, peak within 15% of the planner's `stock_attention='unfused'` terms;
- a PackedStep built from the packer's plan has the micro-batches (and replicated rows) the
  training script runs.
Derived formulas pinned here: the unfused scores, the stock logits' peak, the element-wise time.
The GPU side is compared in docs/PLANNER.md ("Measured GPU runs"), not here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from megatron_dualkv.flops import group_pairs
from megatron_dualkv import planner
from megatron_dualkv.planner import (
    CPU_LOCAL, GIB, H100, Implementation, MicroBatch, ModelShape, Parallel, Workload, make_plan, micro_batch_flops,
    packed_step, static_bytes, sweep, unfused_score_entries,
)

VOCAB = 256


@pytest.fixture(scope="module")
def megatron_cpu():
    from megatron_cpu import cuda_rng_state_on_cpu, gloo_world_of_one, megatron_cpu_shims, model_parallel

    with contextlib.ExitStack() as stack:
        stack.enter_context(gloo_world_of_one())
        stack.enter_context(megatron_cpu_shims())
        stack.enter_context(cuda_rng_state_on_cpu())
        yield stack.enter_context(model_parallel())


def tiny_model(size: str, pgs, vocab: int = VOCAB, dualkv: bool = True, **overrides):
    from megatron_dualkv.megatron import build_dualkv_model, build_replicated_model, qwen3_config

    split = {k: overrides.pop(k) for k in ("cp_chunks_per_rank", "cp_chunk_multiple") if k in overrides}
    cfg = qwen3_config(size, vocab_size=vocab, use_cpu_initialization=True, params_dtype=torch.bfloat16, **overrides)
    torch.manual_seed(3)
    build = build_dualkv_model if dualkv else build_replicated_model
    model = build(cfg, pg_collection=pgs, use_transformer_engine=False, **split).to(torch.bfloat16)
    return cfg, model


def one_group(p: int, n: int, r: int, vocab: int = VOCAB):
    from megatron_dualkv.layout import Group, build_layout

    g = torch.Generator().manual_seed(p * 1000 + n)
    ids = lambda k: torch.randint(1, vocab, (k,), generator=g).tolist()
    return build_layout([Group.of(ids(p), [ids(r) for _ in range(n)])], vocab_size=vocab)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------------------------------
# Weights, gradients, optimizer state: Megatron's own objects
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def bf16_params_look_like_cuda():
    """Megatron's mixed-precision optimizer accepts only torch.cuda.*Tensor parameters (it checks
    param.type()); on the CPU, report the CUDA name while it is built. Test-only shim."""
    original = torch.nn.Parameter.type

    def cuda_type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    torch.nn.Parameter.type = cuda_type
    try:
        yield
    finally:
        torch.nn.Parameter.type = original


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_weight_gradient_and_adam_bytes_equal_megatrons(megatron_cpu, size):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    pgs = megatron_cpu
    cfg, model = tiny_model(size, pgs)
    # what pretrain() builds for --bf16: fp32 gradient buffer, fp32 master weights + Adam
    ddp = DistributedDataParallel(cfg.transformer, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False), model, pg_collection=pgs)
    with bf16_params_look_like_cuda():
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=False,
            clip_grad=0.0), [ddp], use_gloo_process_groups=False, pg_collection=pgs)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(layout=one_group(20, 3, 6)).logprobs.sum().backward()
    assert opt.step()[0], "Megatron's optimizer skipped the step"

    weights = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(b.grad_data) for b in ddp.buffers + ddp.expert_parallel_buffers)
    adam = 0
    for o in opt.chained_optimizers:
        adam += sum(nbytes(p) for g in o.fp32_from_float16_groups for p in g)
        adam += sum(nbytes(v) for st in o.optimizer.state.values() for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0)
    assert adam > 0 and grads > 0
    want = static_bytes(ModelShape.preset(size, vocab_size=VOCAB), Parallel(distributed_optimizer=False))
    assert (weights, grads, adam) == (want["weights"], want["grads"], want["optimizer"])
    expert_params = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    assert expert_params == ModelShape.preset(size, vocab_size=VOCAB).param_counts()["expert"]


# ------------------------------------------------------------------------------------------------
# Activations: saved bytes and the live peak of forward + backward
# ------------------------------------------------------------------------------------------------

class LiveBytes(TorchDispatchMode):
    """Tracks every storage an op creates until it is freed; `peak` is the most alive at once."""

    def __init__(self, exclude: set):
        super().__init__()
        self.exclude = exclude
        self.refs: dict = {}
        self.peak = 0

    def track(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in self.refs and s._cdata not in self.exclude:
                    self.refs[s._cdata] = (StorageWeakRef(s), s.nbytes())
        live = 0
        for key, (ref, n) in list(self.refs.items()):
            if ref.expired():
                del self.refs[key]
            else:
                live += n
        self.peak = max(self.peak, live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


def flash_style_attention(tracker: LiveBytes):
    """The reference attention behind an autograd boundary that saves what a flash kernel saves
    (q, k, v, out, fp32 LSE) and recomputes in backward. Its own T x T work is not tracked (a
    flash kernel keeps it on chip); its outputs are."""
    from megatron_dualkv.ops.reference import reference_attention

    class FlashStyle(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, segments, scale, q_rows):
            with _disable_current_modes(), torch.no_grad():
                out, lse = reference_attention(q, k, v, segments, scale, q_rows=q_rows)
            tracker.track((out, lse))
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.segments, ctx.scale, ctx.q_rows = segments, scale, q_rows
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, _, _ = ctx.saved_tensors
            with _disable_current_modes(), torch.enable_grad():
                qkv = [t.detach().requires_grad_() for t in (q, k, v)]
                out, _ = reference_attention(*qkv, ctx.segments, ctx.scale, q_rows=ctx.q_rows)
                dq, dk, dv = torch.autograd.grad(out, qkv, grad)
            tracker.track((dq, dk, dv))
            return dq, dk, dv, None, None, None

    return lambda q, k, v, segments, scale, q_rows=None: FlashStyle.apply(q, k, v, segments, scale, q_rows)


def flash_style_stock_attention(tracker: LiveBytes):
    """Megatron's DotProductAttention (bshd, causal rows of equal length) replaced by a flash-style
    function: saves q, k, v, out and a fp32 LSE-sized tensor, recomputes in backward (the stock
    rows then model TE / cuDNN attention, not the local spec's T x T scores)."""
    import torch.nn.functional as F

    def attend(q, k, v):  # [s, b, h, d] with GQA -> [s, b, hq, d]
        rep = q.shape[2] // k.shape[2]
        qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qq, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1),
                                             is_causal=True)
        return out.permute(2, 0, 1, 3).contiguous()

    class FlashStyle(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            with _disable_current_modes(), torch.no_grad():
                out = attend(q, k, v)
                lse = torch.zeros(q.shape[1], q.shape[2], q.shape[0], dtype=torch.float32)
            tracker.track((out, lse))
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, _, _ = ctx.saved_tensors
            with _disable_current_modes(), torch.enable_grad():
                qkv = [t.detach().requires_grad_() for t in (q, k, v)]
                grads = torch.autograd.grad(attend(*qkv), qkv, grad)
            tracker.track(grads)
            return grads

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        out = FlashStyle.apply(query, key, value)
        return out.view(out.shape[0], out.shape[1], -1)

    return forward


def measure_activations(size: str, recompute: str, p: int, n: int, r: int, pgs, monkeypatch, vocab: int = VOCAB,
                        stock: Optional[str] = None, unfused: bool = False, **model_overrides) -> tuple[int, int]:
    """(bytes saved for backward, live peak of forward + backward) of one group: DualKV, or with
    `stock` the replicated batch through the stock GPTModel ('edges': our replicated_logprobs,
    'all_rows': GPTModel's own loss over every row). unfused: the stock model keeps Megatron's own
    DotProductAttention (the local spec's [rows, heads, S, S] scores) instead of a flash-style one."""
    import megatron_dualkv.ops.reference_backend as reference_backend
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron_dualkv.megatron.replicated import replicated_batch, replicated_logprobs

    extra = {"full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective"),  # Megatron's default: core_attn
             "none": {}}[recompute]
    if unfused:  # as the training script runs it (Megatron's --attention-softmax-in-fp32 is off by default)
        extra["attention_softmax_in_fp32"] = False
    _, model = tiny_model(size, pgs, vocab, dualkv=stock is None, **extra, **model_overrides)
    layout = one_group(p, n, r, vocab)
    # gradients go to a preallocated fp32 buffer (as Megatron DDP's main_grad), not to new tensors
    main = {q: torch.zeros(q.shape, dtype=torch.float32) for q in model.parameters()}

    def accumulate(q):
        main[q].add_(q.grad)
        q.grad = None

    for q in model.parameters():
        q.register_post_accumulate_grad_hook(accumulate)
    exclude = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(main.values())}
    tracker = LiveBytes(exclude)
    monkeypatch.setattr(reference_backend, "attention", flash_style_attention(tracker))
    if not unfused:
        monkeypatch.setattr(DotProductAttention, "forward", flash_style_stock_attention(tracker))
    batch = replicated_batch(layout)
    labels = torch.roll(batch.input_ids, -1, dims=1)

    def loss():
        if stock is None:
            return model(layout=layout).logprobs.sum()
        if stock == "edges":
            return replicated_logprobs(model, layout).logprobs.sum()
        return model(batch.input_ids, batch.position_ids, batch.attention_mask, labels=labels).sum()

    loss().backward()  # warm the layout's caches (rotary table, ...)
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    saved: dict = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved.setdefault(s.data_ptr(), s.nbytes())
        return t

    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = loss()
        out.backward()
        del out
    return sum(saved.values()), tracker.peak


@pytest.mark.parametrize("size,recompute,vocab,stock", [
    ("tiny", "none", VOCAB, None), ("tiny", "none", 16, None), ("tiny", "selective", VOCAB, None),
    ("tiny", "full", 16, None), ("tiny-moe", "none", 16, None), ("tiny-moe", "full", VOCAB, None),
    ("tiny", "none", VOCAB, "edges"), ("tiny", "none", VOCAB, "all_rows"), ("tiny-moe", "none", VOCAB, "all_rows"),
])
def test_saved_activations_and_peak_match_the_planner(megatron_cpu, monkeypatch, size, recompute, vocab, stock):
    """vocab 16 makes the logits negligible, so the peak is the layers' backward workspace; vocab
    256 makes it the logits' (as at vocab 151,936 on a GPU)."""
    p, n, r = 100, 6, 30
    saved, peak = measure_activations(size, recompute, p, n, r, megatron_cpu, monkeypatch, vocab, stock)
    impl = dataclasses.replace(CPU_LOCAL, stock_logits=stock or "all_rows")
    plan = make_plan(ModelShape.preset(size, vocab_size=vocab), Parallel(distributed_optimizer=False),
                     Workload(n, p, r, groups_per_step=1, dualkv=stock is None), recompute, impl)
    m = plan.memory
    want_saved = m["activations"] + m["logits"]
    want_peak = want_saved + m["transient"]
    assert abs(saved / want_saved - 1) < 0.015, (saved, want_saved)
    assert abs(peak / want_peak - 1) < 0.15, (peak, want_peak)
    # the formula is not trivially satisfied: dropping one [tokens, hidden] bf16 term per layer breaks it
    h, L, T = 64, 2, (p + n * r) if stock is None else n * (p + r)
    if recompute == "none":
        assert abs(saved / (want_saved - 2 * h * T * L) - 1) > 0.015


CP_GROUP = (100, 6, 30)  # 280 tokens: split into 2 ranks x 2 chunks of a multiple of 2 rows, no CP padding


def cp_saved_activations_worker(comm: str) -> int:
    """Bytes one rank of a CP=2 gloo world saves for backward (tiny DualKV model, one group)."""
    from megatron_cpu import model_parallel

    patch = pytest.MonkeyPatch()
    try:
        with model_parallel(cp=2) as pgs:
            saved, _ = measure_activations("tiny", "none", *CP_GROUP, pgs, patch, VOCAB, context_parallel_size=2,
                                           cp_comm_type=comm, cp_chunks_per_rank=2, cp_chunk_multiple=2)
    finally:
        patch.undo()
    return saved


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_cp_saved_activations_match_the_planner(comm):
    """Context parallelism: the all-gather variant keeps the gathered K and V of every row; the
    all-to-all variant keeps the attention's output (its heads of every row) and linear_proj's
    input (the rows after the all-to-all back) as two tensors. The planner predicts the mean over
    the CP ranks (it splits rows and loss edges evenly; the partition balances attention work, so
    one rank's edges, hence logits, are a few % above the other's here)."""
    from megatron_cpu import GlooWorkers

    p, n, r = CP_GROUP
    with GlooWorkers(2, timeout_s=240) as workers:
        saved = workers.run(cp_saved_activations_worker, comm, world_size=2)
    shape = ModelShape.preset("tiny", vocab_size=VOCAB)
    plan = make_plan(shape, Parallel(cp=2, cp_comm=comm, distributed_optimizer=False),
                     Workload(n, p, r, groups_per_step=1), "none", CPU_LOCAL)
    want = plan.memory["activations"] + plan.memory["logits"]
    got = sum(saved) / len(saved)
    assert abs(got / want - 1) < 0.015, (comm, saved, want)
    # not trivially satisfied: the a2a term (one more [local rows, Hq d] bf16 tensor per layer) or,
    # for the all-gather, the gathered K/V term (4 Hkv d B per row of the whole micro-batch) moved
    # the prediction by more than the tolerance
    local, total, hq_d, kv_d = (p + n * r) / 2, p + n * r, shape.num_attention_heads * shape.kv_channels, \
        shape.num_query_groups * shape.kv_channels
    term = 2 * hq_d * local if comm == "a2a" else 4 * kv_d * (total - local)
    assert abs(got / (want - term * shape.num_layers) - 1) > 0.015, (comm, saved, want, term)


def test_unfused_stock_attention_matches_megatrons_dot_product_attention(megatron_cpu, monkeypatch):
    """`--no-dualkv` without TE runs Megatron's DotProductAttention: the planner's unfused terms
    (bf16 probabilities per layer, q and K/V repeated to every query head, no LSE) against the bytes
    that module really saves, and the peak with its score-sized backward gradients."""
    p, n, r = 100, 6, 30
    saved, peak = measure_activations("tiny", "none", p, n, r, megatron_cpu, monkeypatch, 16, "edges", unfused=True)
    impl = dataclasses.replace(CPU_LOCAL, stock_logits="edges", stock_attention="unfused")
    shape = ModelShape.preset("tiny", vocab_size=16)
    plan = make_plan(shape, Parallel(distributed_optimizer=False), Workload(n, p, r, groups_per_step=1, dualkv=False),
                     "none", impl)
    m = plan.memory
    assert abs(saved / (m["activations"] + m["logits"]) - 1) < 0.015, (saved, m["activations"] + m["logits"])
    assert abs(peak / (m["activations"] + m["logits"] + m["transient"]) - 1) < 0.15
    # the flash-style formula (no scores) misses them: the test can tell the two apart
    flash = make_plan(shape, Parallel(distributed_optimizer=False), Workload(n, p, r, groups_per_step=1, dualkv=False),
                      "none", dataclasses.replace(impl, stock_attention="flash")).memory
    assert saved / (flash["activations"] + flash["logits"]) - 1 > 0.15


# ------------------------------------------------------------------------------------------------
# Arithmetic of the model
# ------------------------------------------------------------------------------------------------

def test_unfused_attention_terms_are_the_derived_formula():
    """Per layer: 2 B x rows x heads/TP x S^2 probabilities saved, 4 B more in backward (two
    score-sized bf16 gradients), the baddbmm buffer (2 B) kept by Megatron's global buffer; per
    token q, K and V repeated to Hq heads (6 Hq d B) and the output (2 Hq d B) instead of the flash
    kernel's q, k, v, output and fp32 LSE."""
    shape = ModelShape.preset("8b", num_layers=3)
    L, d, hq, hkv = 3, 128, 32, 8
    for tp in (1, 2):
        par = Parallel(tp=tp, distributed_optimizer=False)
        mb = MicroBatch(5 * 3000, 0, 5 * 3000, 5 * 900, 5, "5 rows", row_width=3000)
        work = Workload(5, 2100, 900, groups_per_step=1, dualkv=False)
        unf = Implementation(stock_logits="edges", stock_attention="unfused")
        flash = dataclasses.replace(unf, stock_attention="flash")
        scores = 5 * (hq // tp) * 3000 ** 2
        assert unfused_score_entries(shape, par, unf, False, mb) == scores
        assert unfused_score_entries(shape, par, flash, False, mb) == 0
        assert unfused_score_entries(shape, par, unf, True, mb) == 0  # DualKV never has scores
        a, b = planner._memory(shape, par, work, "none", unf, mb), planner._memory(shape, par, work, "none", flash, mb)
        per_token = (6 * hq * d + 2 * hq * d - (2 * (hq + 2 * hkv) * d + 2 * hq * d + 4 * hq)) / tp
        assert a["activations"] - b["activations"] == pytest.approx(L * (2 * scores + per_token * mb.tokens))
        sp_gather = 2 * shape.hidden_size * mb.tokens if tp > 1 else 0
        assert a["buffers"] == 2 * scores and b["buffers"] == sp_gather
    with pytest.raises(ValueError, match="context parallelism"):
        unfused_score_entries(shape, Parallel(cp=2), unf, False, mb)


def test_fused_k_norm_keeps_the_fused_qkv_output_alive():
    """On CUDA torch's RMSNorm (Megatron's local norm) runs _fused_rms_norm, which saves its input:
    for K that is a view of the fused QKV output, so the whole QKV output lives until backward even
    though the DualKV core attention copies K and V. The composite (CPU) norm saves a fp32 copy."""
    import subprocess
    import sys

    # its own process: this module's Megatron CPU shims map device="cuda" to the CPU
    probe = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
saved = []
with FakeTensorMode():  # CUDA dispatch without a GPU
    qkv = torch.empty(64, 1, 8, 6 * 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weight = torch.empty(128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    _, key, _ = torch.split(qkv, [4 * 128, 128, 128], dim=3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.rms_norm(key, (128,), weight, 1e-6)
    print([t.untyped_storage().nbytes() for t in saved if t.dtype == torch.bfloat16 and t.dim() == 4])
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str([64 * 8 * 6 * 128 * 2])  # the saved K: all of the QKV storage
    shape = ModelShape.preset("8b")
    d, hq, hkv = 128, 32, 8
    assert planner.layer_activation_terms(shape, Implementation(), dualkv=True)["qkv_output"] == 2 * (hq + 2 * hkv) * d
    assert planner.layer_activation_terms(shape, CPU_LOCAL, dualkv=True)["qkv_output"] == 0
    unfused_cpu = dataclasses.replace(CPU_LOCAL, stock_attention="unfused")
    assert planner.layer_activation_terms(shape, unfused_cpu, dualkv=False)["qkv_output"] == 0  # V copied too
    assert planner.layer_activation_terms(shape, CPU_LOCAL, dualkv=False)["qkv_output"] > 0  # V saved as the view


def test_stock_edges_logits_are_the_derived_peak():
    """replicated_logprobs: GPTModel returns [b, s, v] = a contiguous copy of the [s, b, v] logits, so
    the output layer's backward holds the gradient and its contiguous copy (4 B per [row, vocab/TP]
    entry) with its input and weight gradients; the forward's edge rows take bf16 + fp32 cast + its
    division (10 B per edge entry) beside the 2 B logits; the log-softmax (TP=1) or Megatron's CE keeps
    4 B per edge entry."""
    shape = ModelShape.preset("8b", num_layers=2)
    h = shape.hidden_size
    for tp, rows, edges in ((1, 24560, 6023), (2, 49120, 9125), (1, 24560, 20000)):
        par = Parallel(tp=tp, distributed_optimizer=False)
        mb = MicroBatch(rows, 0, rows, edges, 8, "x", row_width=rows // 8)
        work = Workload(8, 2048, 1000, dualkv=False)
        m = planner._memory(shape, par, work, "none", Implementation(stock_logits="edges"), mb)
        v = shape.vocab_size / tp
        want = max(4 * rows * v + 2 * h * rows + 2 * h * v, (2 * rows + 10 * edges) * v, (12 if tp == 1 else 8) * edges * v)
        assert m["logits"] == 4 * edges * v
        assert m["transient"] == pytest.approx(want - 4 * edges * v)  # the logits outweigh the layers' workspace here


def test_time_counts_unfused_squares_and_element_wise_passes():
    """The unfused stock attention multiplies full S x S squares per (row, head) at the matmul rate;
    the element-wise passes over the logits and the scores cost their HBM bytes (counted per op)."""
    shape = ModelShape.preset("8b", num_layers=2)
    par = Parallel(tp=2, distributed_optimizer=False)
    unf = Implementation(stock_logits="edges", stock_attention="unfused")
    mb = MicroBatch(8 * 3000, 8 * (2000 * 2001 // 2), 8 * 3000, 8 * 1000, 8, "8 rows", row_width=3000)
    plan = make_plan(shape, par, Workload(8, 2000, 1000, groups_per_step=1, dualkv=False), "none", unf)
    t = planner.micro_batch_time(plan, mb)
    scores = 8 * 16 * 3000 ** 2  # rows x heads/TP x S^2
    assert t["attention"] == pytest.approx(3 * 2 * 4 * 128 * scores / (H100.matmul_tflops * 1e12))
    v = shape.vocab_size / 2
    want = (10 * 24000 * v + 84 * 8000 * v) + 30 * 2 * scores  # rows, edges (TP > 1), scores of 2 layers
    assert t["memory_bound"] == pytest.approx(want / (H100.hbm_gbps * 1e9))
    dual = make_plan(shape, par, Workload(8, 2000, 1000, groups_per_step=1))
    edges = dual.largest.loss_edges
    assert planner.micro_batch_time(dual, dual.largest)["memory_bound"] == pytest.approx(
        64 * edges * v / (H100.hbm_gbps * 1e9))  # no scores: the [edges, vocab/TP] passes only


def test_packed_step_is_what_the_training_script_runs():
    """A PackedStep from the packer's plan: DualKV micro-batches padded to the TP multiple, and the
    --no-dualkv rows exactly as megatron.replicated.replicated_batch builds them from the same
    micro-batches; the step's peak is the worst micro-batch, not the one with the most tokens."""
    from megatron_dualkv.data import RolloutGroup
    from megatron_dualkv.megatron.replicated import replicated_batch
    from megatron_dualkv.packing import PackingConfig, build_micro_batches, plan_packing

    g = torch.Generator().manual_seed(5)
    ids = lambda k: torch.randint(1, 200, (k,), generator=g).tolist()
    records = [RolloutGroup(group_id=f"g{i}", prompt=ids(40 + 13 * i), responses=[ids(5 + 7 * j + i) for j in range(3 + i % 3)],
                            advantages=[0.5] * (3 + i % 3)) for i in range(6)]
    cfg = PackingConfig(max_tokens=240, dp_size=2, pad_to_multiple=2, vocab_size=200, seed=3)
    plan = plan_packing(records, cfg)
    dual, stock = packed_step(records, plan, True, 2), packed_step(records, plan, False, 2)
    assert dual.useful_totals() == stock.useful_totals()
    assert dual.useful_totals()[0] == sum(len(r.prompt) + sum(r.response_lengths) for r in records)
    for rank in range(2):
        built = build_micro_batches(records, plan, rank, "cpu")
        assert len(built) == len(dual.ranks[rank]) == len(stock.ranks[rank])
        for mb, d, s in zip(built, dual.ranks[rank], stock.ranks[rank]):
            batch = replicated_batch(mb.layout, pad_to_multiple=2)
            assert (s.responses, s.row_width) == tuple(batch.input_ids.shape)
            assert s.loss_edges == d.loss_edges == d.logit_rows == mb.layout.num_edges
            assert d.tokens == mb.layout.num_tokens and d.tokens % 2 == 0
    shape = ModelShape.preset("tiny")
    par = Parallel(tp=2, dp=2, distributed_optimizer=False)
    impl = Implementation(stock_logits="edges", stock_attention="unfused")
    plan_stock = make_plan(shape, par, stock, "none", impl)
    each = [planner._memory(shape, par, stock, "none", impl, mb, plan_stock.memory["buffers"])["total"]
            for mb in stock.micro_batches()]
    assert plan_stock.memory["total"] == max(each)
    assert plan_stock.memory["buffers"] == max(2 * unfused_score_entries(shape, par, impl, False, mb)
                                               for mb in stock.micro_batches())
    assert plan_stock.micro_batches_per_rank == plan.num_micro_batches_per_rank
    with pytest.raises(ValueError, match="data-parallel ranks"):
        make_plan(shape, Parallel(tp=2, dp=1), stock, "none", impl)

def test_preset_parameter_counts_are_the_published_sizes():
    q8, q30 = ModelShape.preset("8b"), ModelShape.preset("30b-a3b")
    assert abs(q8.total_params() / 8.19e9 - 1) < 0.005  # Qwen3-8B: 8.2B
    assert abs(q30.total_params() / 30.5e9 - 1) < 0.005  # Qwen3-30B-A3B: 30.5B total
    active = q30.active_params_per_token() + 2 * 151936 * 2048  # + embedding and output layer: 3.3B activated
    assert abs(active / 3.3e9 - 1) < 0.05


def test_micro_batches_count_tokens_pairs_and_logit_rows():
    n, p, r, G = 8, 1000, 50, 3
    dual = Workload(n, p, r, groups_per_step=G).micro_batches()
    pairs, repl_pairs = group_pairs(p, [r] * n)
    assert [m.tokens for m in dual] == [p + n * r] * G and [m.attention_pairs for m in dual] == [pairs] * G
    assert all(m.logit_rows == n * r for m in dual)  # logits only at the loss edges
    split = Workload(n, p, r, groups_per_step=G, responses_per_micro_batch=3).micro_batches()
    assert len(split) == 3 * G and sorted({m.responses for m in split}) == [2, 3]  # 8 = 3 + 3 + 2
    assert sum(m.tokens for m in split) == G * (3 * p + n * r)  # each sub-group carries the prompt
    stock = Workload(n, p, r, groups_per_step=G, dualkv=False).micro_batches()
    assert sum(m.tokens for m in stock) == G * n * (p + r) == sum(m.logit_rows for m in stock)  # logits everywhere
    assert sum(m.attention_pairs for m in stock) == G * repl_pairs
    budget = Workload(n, p, r, groups_per_step=G, max_tokens=p + 5 * r).micro_batches()
    assert max(m.tokens for m in budget) <= p + 5 * r and len(budget) == 2 * G
    with pytest.raises(ValueError, match="max_tokens"):
        Workload(n, p, r, max_tokens=p).micro_batches()


def test_flops_agree_with_the_training_scripts_mfu_convention():
    shape = ModelShape.preset("30b-a3b")
    work = Workload(16, 8192, 1024, groups_per_step=2)
    plan = make_plan(shape, Parallel(ep=8, dp=8), work)
    tokens, pairs, edges = work.useful_totals()
    want = shape.step_flops(tokens, pairs, edges)
    assert plan.flops["useful"] == pytest.approx(want, rel=1e-12)
    assert plan.flops["executed"] == pytest.approx(want, rel=1e-12)  # DualKV, no recomputation: all useful
    stock = make_plan(shape, Parallel(ep=8, dp=8), dataclasses.replace(work, dualkv=False))
    mb = stock.workload.micro_batches()
    want_stock = sum(shape.step_flops(m.tokens, m.attention_pairs, m.logit_rows) for m in mb)
    assert stock.flops["executed"] == pytest.approx(want_stock, rel=1e-12)
    assert stock.flops["useful"] == plan.flops["useful"] and stock.mfu < plan.mfu
    full = micro_batch_flops(shape, mb[0], "full")
    none = micro_batch_flops(shape, mb[0], "none")
    assert full["dense"] == pytest.approx(none["dense"] * 4 / 3) and full["attention"] == pytest.approx(none["attention"] * 4.5 / 3.5)


def test_sharding_of_weights_optimizer_and_logits():
    shape = ModelShape.preset("30b-a3b")
    c = shape.param_counts()
    one = static_bytes(shape, Parallel(ep=8, dp=16))
    dense = c["tp"] + c["vocab"] + c["replicated"]
    assert one["weights"] == 2 * (dense + c["expert"] / 8)
    assert one["optimizer"] == pytest.approx(12 * (dense / 16 + c["expert"] / 8 / 2))  # dist. optimizer: DP, expert DP
    plain = static_bytes(shape, Parallel(ep=8, dp=16, distributed_optimizer=False))
    assert plain["optimizer"] == 6 * one["weights"]  # 12 bytes for every local parameter
    tp2 = static_bytes(shape, Parallel(tp=2, ep=8, dp=8))
    assert tp2["weights"] == 2 * ((c["tp"] + c["vocab"]) / 2 + c["replicated"] + c["expert"] / 8)

    n, p, r = 4, 2048, 512
    for dualkv, rows in ((True, n * r), (False, n * (p + r))):
        for tp in (1, 4):
            plan = make_plan(shape, Parallel(tp=tp, ep=8, dp=16 // tp), Workload(n, p, r, dualkv=dualkv))
            assert plan.memory["logits"] == 4 * rows * shape.vocab_size / tp  # fp32 [rows, vocab/TP]
    # what-if chunked logits: nothing held, one chunk's transient, one more output-layer forward
    work = Workload(n, p, r)
    whole = make_plan(shape, Parallel(ep=8, dp=16), work)
    chunked = make_plan(shape, Parallel(ep=8, dp=16), work, impl=Implementation(logits_chunk_rows=256))
    assert chunked.memory["logits"] == 0 and chunked.memory["total"] < whole.memory["total"]
    assert chunked.flops["logits"] == pytest.approx(whole.flops["logits"] * 4 / 3)


def test_layouts_megatron_refuses_are_refused():
    shape = ModelShape.preset("30b-a3b")
    with pytest.raises(ValueError, match="query groups"):
        Parallel(tp=8).check(shape)  # 4 KV heads
    with pytest.raises(ValueError, match="experts"):
        Parallel(ep=3, dp=3).check(shape)
    with pytest.raises(ValueError, match="pipeline"):
        Parallel(pp=2)
    with pytest.raises(ValueError, match="world size"):
        Parallel(ep=16, dp=8)
    with pytest.raises(ValueError, match="recompute"):
        make_plan(shape, Parallel(), Workload(2, 8, 8), recompute="some")
    with pytest.raises(ValueError, match="norm"):
        Implementation(norm="apex")
    # one ModelShape describes any Megatron config; the planner refuses what it does not model
    plain_mlp = dataclasses.replace(ModelShape.preset("8b"), gated_linear_unit=False)
    with pytest.raises(ValueError, match="SwiGLU"):
        make_plan(plain_mlp, Parallel(), Workload(2, 8, 8))
    shared = dataclasses.replace(shape, moe_shared_expert_intermediate_size=512)
    with pytest.raises(ValueError, match="shared experts"):
        Parallel(ep=8, dp=8).check(shared)
    assert shared.token_matmul_flops() == shape.token_matmul_flops() + shape.num_layers * 2 * 3 * shape.hidden_size * 512


def test_sweep_ranks_fitting_layouts_and_dualkv_wins_on_long_prompts():
    shape = ModelShape.preset("8b")
    plans = sweep(shape, 8, 32, 8192, 2048, groups_per_step=8)
    assert plans and all(pl.fits for pl in plans)
    times = [pl.step_time_s for pl in plans]
    assert times == sorted(times)
    labels = {(pl.parallel.label(), pl.workload.dualkv) for pl in plans}
    assert len(labels) == len(plans)  # one plan per layout and mode
    best_dual = next(pl for pl in plans if pl.workload.dualkv)
    best_stock = next(pl for pl in plans if not pl.workload.dualkv)
    assert best_dual.step_time_s < best_stock.step_time_s
    assert best_dual.memory["total"] + H100.reserve_gib * GIB <= H100.memory_gib * GIB


def test_cli_prints_a_table_and_a_sweep(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "plan_memory.py")
    spec = importlib.util.spec_from_file_location("plan_memory", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    cli.main(["--model", "30b-a3b", "--ep", "8", "--dp", "16", "--n", "32", "--p", "8192", "--r", "2048",
              "--responses-per-micro-batch", "4", "--recompute", "full"])
    out = capsys.readouterr().out
    assert "| logits held fp32 GiB |" in out and "DualKV" in out and "stock (replicated)" in out
    cli.main(["--layers", "4", "--hidden", "512", "--ffn", "1024", "--heads", "8", "--query-groups", "4",
              "--kv-channels", "64", "--vocab", "1024", "--sweep", "--world", "4", "--n", "8", "--p", "512",
              "--r", "128", "--top", "3"])
    out = capsys.readouterr().out
    assert "## DualKV" in out and "## stock (replicated)" in out and "predicted" in out
