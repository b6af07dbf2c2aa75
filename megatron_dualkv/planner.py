"""Memory and step-time planner for GRPO policy updates, DualKV or replicated, on Megatron-Core.

    shape = ModelShape.preset("30b-a3b")
    par = Parallel(tp=1, ep=8, dp=16)
    work = Workload(n=32, p=8192, r=2048, groups_per_step=16, dualkv=True, responses_per_micro_batch=8)
    plan = make_plan(shape, par, work, recompute="full")
    plan.memory_gib()["total"], plan.fits, plan.step_time_s, plan.mfu

    sweep(shape, world=16, n=32, p=8192, r=2048)   # every layout that fits, fastest first

What it models (docs/PLANNER.md gives every formula and the assumptions behind each number):
- per-GPU memory: bf16 weights, fp32 main gradients, fp32 Adam master/m/v (sharded over the data
  parallel group by the distributed optimizer), activations saved for backward per layer and
  token (Megatron's local/TE layers, flash-style attention: no T x T scores, only the LSE),
  the logits [rows, vocab/TP] in fp32 (DualKV: loss edges only; stock: every token), MoE
  dispatch buffers, a fixed reserve (CUDA context, NCCL, fragmentation);
- per-step FLOPs: 3x forward for matmuls (MoE: router + top-k experts only), 3.5x forward for
  attention over the attended (query, key) pairs of megatron_dualkv.flops, the output layer on
  the rows whose logits are computed; plus the recomputed forward under recomputation;
- time: FLOPs at stated achieved rates (matmul, expert GEMM, attention per implementation) plus
  TP / CP / EP / DP communication at stated bandwidths, nothing overlapped (an upper bound);
- MFU: deduplicated useful FLOPs (what DualKV computes, without recomputation) / (time x peak x GPUs),
  the convention of the training script's log; every FLOP formula is megatron_dualkv.model_shape's.
- the stock path as `--no-dualkv` runs it without TE (Implementation(stock_attention='unfused'):
  [rows, heads, S, S] scores, rows padded per micro-batch) and Megatron's persistent global buffer;
- a step as the packer made it (PackedStep / packed_step from a packing.PackingPlan), the peak over
  its micro-batches.
Checked on CPU against a tiny Megatron model (tests/test_planner.py) and against the GPU runs of
docs/PERF.md (docs/PLANNER.md, "Measured GPU runs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .flops import FWD_BWD_FACTOR, group_pairs
from .model_shape import MATMUL_FWD_BWD_FACTOR, ModelShape

GIB = 1024 ** 3
RECOMPUTE = ("none", "selective", "full")
# backward transient as a fraction of one layer's saved activations (see _memory)
WORKSPACE_NONE = 0.25
WORKSPACE_FULL = 1.0


def require_modelled(shape: ModelShape) -> None:
    """The activation and parameter model covers SwiGLU MLPs without shared experts."""
    if not shape.gated_linear_unit:
        raise ValueError(f"shape {shape.name!r}: the planner models SwiGLU (gated) MLPs only")
    if shape.moe_shared_expert_intermediate_size:
        raise ValueError(f"shape {shape.name!r}: the planner does not model shared experts")


# ------------------------------------------------------------------------------------------------
# Parallel layout
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parallel:
    """Megatron degrees (PP = 1). world = tp * cp * dp; experts: ep * etp * expert_dp = world."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    sp: Optional[bool] = None  # sequence parallelism; None: on when tp > 1
    pp: int = 1
    distributed_optimizer: bool = True
    cp_comm: str = "all_gather"  # DualKV CP: K/V all-gathered over the CP group ('a2a': Ulysses)

    def __post_init__(self):
        for f in ("tp", "cp", "dp", "ep", "etp", "pp"):
            if getattr(self, f) < 1:
                raise ValueError(f"Parallel.{f} must be >= 1, got {getattr(self, f)}")
        if self.pp != 1:
            raise ValueError("pipeline parallelism is not modelled: the training script refuses PP > 1 "
                             "(packed micro-batches have variable shapes)")
        if self.world % (self.ep * self.etp):
            raise ValueError(f"ep * etp = {self.ep * self.etp} must divide the world size {self.world} "
                             f"(tp {self.tp} x cp {self.cp} x dp {self.dp})")
        if self.cp_comm not in ("all_gather", "a2a"):
            raise ValueError(f"cp_comm must be 'all_gather' or 'a2a', got {self.cp_comm!r}")
        if self.sp is None:
            object.__setattr__(self, "sp", self.tp > 1)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.etp)

    def check(self, shape: ModelShape) -> None:
        """Raise ValueError when Megatron would refuse this layout for the shape (or the planner
        does not model the shape)."""
        require_modelled(shape)
        if shape.num_attention_heads % self.tp or shape.num_query_groups % self.tp:
            raise ValueError(f"tp {self.tp} must divide the attention heads ({shape.num_attention_heads}) and the "
                             f"query groups ({shape.num_query_groups})")
        if shape.vocab_size % self.tp:
            raise ValueError(f"tp {self.tp} must divide the vocabulary ({shape.vocab_size}) (Megatron pads it otherwise)")
        if shape.is_moe:
            if shape.num_moe_experts % self.ep:
                raise ValueError(f"ep {self.ep} must divide the experts ({shape.num_moe_experts})")
            if shape.moe_ffn_hidden_size % self.etp:
                raise ValueError(f"etp {self.etp} must divide moe_ffn_hidden_size ({shape.moe_ffn_hidden_size})")
            if self.tp > 1 and not self.sp:
                raise ValueError("Megatron requires sequence parallelism for MoE with tp > 1")
        elif self.ep != 1 or self.etp != 1:
            raise ValueError("a dense model has no experts: ep and etp must be 1")
        if self.cp_comm == "a2a" and self.cp > 1:
            if (shape.num_attention_heads // self.tp) % self.cp or (shape.num_query_groups // self.tp) % self.cp:
                raise ValueError(f"cp_comm 'a2a' splits heads: cp {self.cp} must divide the heads per TP rank")

    def label(self) -> str:
        s = f"TP{self.tp}{'+SP' if self.sp and self.tp > 1 else ''} CP{self.cp} DP{self.dp}"
        if self.ep > 1 or self.etp > 1:
            s += f" EP{self.ep}" + (f" ETP{self.etp}" if self.etp > 1 else "") + f" EDP{self.expert_dp}"
        return s


# ------------------------------------------------------------------------------------------------
# How the layers run, the machine, and the work of a step
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Implementation:
    """Which kernels the layers use; each choice changes what is saved for backward.

    norm: 'fused' (TE, or torch's fused CUDA rms_norm: saves the bf16 input and a fp32 rstd) or
      'composite' (torch's decomposed CPU path: fp32 copy of the input, fp32 normalised, rstd).
    rope: 'unfused' (Megatron's local path: cos/sin tables built per call and saved) or 'fused' (TE).
    swiglu: 'fused' (Megatron's bias_swiglu, on with --swiglu in the training script: saves the fc1
      output only) or 'unfused' (chunk, silu, x + 0 offset, products: what qwen3_config gives).
    attention_copies_v: the attention kernel saves its own copy of V (Flex pads q, k, v to 128
      rows) rather than a view into the fused QKV output.
    with_entropy: the DualKV logprobs also keep the fp32 logits for the entropy.
    stock_logits: the stock path's loss: 'all_rows' (Megatron's GPTModel loss: fp32 cross entropy over
      every row) or 'edges' (our --no-dualkv baseline, megatron_dualkv.megatron.replicated: bf16
      logits at every row, fp32 log-softmax at the loss edges only).
    logits_chunk_rows: the model's opt-in chunked output (--logits-chunk-rows): the output layer and logprobs run
      over chunks of this many rows and are recomputed in backward, so no [rows, vocab/TP] fp32
      tensor outlives its chunk (costs one more output-layer forward).
    stock_attention: the stock path's core attention: 'flash' (TE / cuDNN: saves q, k, v, output and a
      fp32 LSE, no scores) or 'unfused' (Megatron's local-spec DotProductAttention, what `--no-dualkv`
      runs without Transformer Engine: [rows, heads, S, S] bf16 scores and probabilities, K and V
      repeated to every query head).
    experts: 'sequential' (Megatron's SequentialMLP or TE's grouped experts: the expert weights are
      saved as themselves) or 'stacked' (GroupedGemmSequentialMLP, --moe-grouped-gemm without TE: each
      MoE layer also keeps its local experts' weights stacked for backward, 2 B per local expert
      parameter, whatever the token count; without expert TP, where that module runs).
    """

    norm: str = "fused"
    rope: str = "unfused"
    swiglu: str = "fused"
    attention_copies_v: bool = True
    with_entropy: bool = False
    stock_logits: str = "all_rows"
    logits_chunk_rows: Optional[int] = None
    stock_attention: str = "flash"
    experts: str = "sequential"

    def __post_init__(self):
        if self.logits_chunk_rows is not None and self.logits_chunk_rows < 1:
            raise ValueError(f"logits_chunk_rows must be >= 1, got {self.logits_chunk_rows}")
        for f, ok in (("norm", ("fused", "composite")), ("rope", ("unfused", "fused")), ("swiglu", ("fused", "unfused")),
                      ("stock_logits", ("all_rows", "edges")), ("stock_attention", ("flash", "unfused")),
                      ("experts", ("sequential", "stacked"))):
            if getattr(self, f) not in ok:
                raise ValueError(f"Implementation.{f} must be one of {ok}, got {getattr(self, f)!r}")


# The CPU measurement of tests/test_planner.py runs exactly this (torch's CPU norm, qwen3_config's MLP).
CPU_LOCAL = Implementation(norm="composite", rope="unfused", swiglu="unfused", attention_copies_v=False)


@dataclass(frozen=True)
class Hardware:
    """Per-GPU capacities and the achieved rates the time estimate assumes (docs/PLANNER.md)."""

    name: str = "H100 80GB"
    memory_gib: float = 79.1  # what torch sees on an H100 80GB HBM3
    reserve_gib: float = 3.0  # CUDA context, NCCL buffers, allocator fragmentation (assumed)
    peak_tflops: float = 989.0  # bf16 dense peak (MFU denominator; training.throughput's value)
    matmul_tflops: float = 600.0  # achieved on the dense projections and MLP (assumed)
    expert_tflops: float = 450.0  # achieved on per-expert GEMMs of a few thousand rows (assumed)
    # attention, useful TF/s (deduplicated FLOPs for DualKV, raw replicated FLOPs for stock), docs/PERF.md
    dualkv_attn_fwd_tflops: float = 410.0  # Flex-Triton dynamic, fwd: 402-422 measured
    dualkv_attn_tflops: float = 340.0  # Flex-Triton dynamic, fwd+bwd: 316-361 measured
    stock_attn_fwd_tflops: float = 600.0  # cuDNN, fwd (DESIGN.md: 576-628)
    stock_attn_tflops: float = 520.0  # cuDNN raw fwd+bwd: 493-552 measured
    gpus_per_node: int = 8
    nvlink_gbps: float = 350.0  # achieved all-gather / reduce-scatter bus bandwidth inside a node, GB/s
    nvlink_a2a_gbps: float = 200.0  # achieved all-to-all bandwidth per GPU inside a node, GB/s
    ib_gbps: float = 40.0  # achieved inter-node bandwidth per GPU (one 400 Gb/s NIC per GPU), GB/s
    hbm_gbps: float = 3000.0  # optimizer step (memory bound)


H100 = Hardware()


@dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch as a layer sees it (whole micro-batch, before CP splitting)."""

    tokens: int  # rows every per-token op processes
    attention_pairs: int  # (query, key) pairs per layer
    logit_rows: int  # rows whose vocabulary logits are computed
    loss_edges: int
    responses: int
    what: str
    # stock (replicated) bshd batch: every one of the `responses` rows is padded to this length
    # (tokens = responses x row_width, padding included); 0 for a packed DualKV micro-batch
    row_width: int = 0


@dataclass(frozen=True)
class Workload:
    """One optimizer step: `groups_per_step` groups of N responses of R tokens on a P-token prompt.

    Micro-batch content, DualKV: whole groups (`groups_per_micro_batch` of them), or sub-groups of
    `responses_per_micro_batch` responses that each carry the prompt (the packer's split), or the
    largest that fits `max_tokens`. Stock (replicated): `responses_per_micro_batch` [prompt|response]
    sequences per micro-batch (default: one group's N), or as many as fit `max_tokens`.
    """

    n: int
    p: int
    r: int
    groups_per_step: int = 16
    dualkv: bool = True
    responses_per_micro_batch: Optional[int] = None
    groups_per_micro_batch: int = 1
    max_tokens: Optional[int] = None

    def __post_init__(self):
        for f in ("n", "p", "r", "groups_per_step", "groups_per_micro_batch"):
            if getattr(self, f) < 1:
                raise ValueError(f"Workload.{f} must be >= 1, got {getattr(self, f)}")
        if self.responses_per_micro_batch is not None and not 1 <= self.responses_per_micro_batch:
            raise ValueError(f"responses_per_micro_batch must be >= 1, got {self.responses_per_micro_batch}")
        if self.responses_per_micro_batch is not None and self.groups_per_micro_batch > 1:
            raise ValueError("give responses_per_micro_batch (split groups) or groups_per_micro_batch, not both")

    def label(self) -> str:
        return f"N={self.n} P={self.p} R={self.r} x{self.groups_per_step} groups, {'DualKV' if self.dualkv else 'stock'}"

    # -- the step's micro-batches -------------------------------------------------------------
    def micro_batches(self) -> list[MicroBatch]:
        return self._dualkv_micro_batches() if self.dualkv else self._stock_micro_batches()

    def _dualkv_micro_batches(self) -> list[MicroBatch]:
        n, p, r, G = self.n, self.p, self.r, self.groups_per_step
        group_tokens = p + n * r
        per_mb, groups_per_mb = self.responses_per_micro_batch, self.groups_per_micro_batch
        if per_mb is None and self.max_tokens is not None:
            if group_tokens <= self.max_tokens:
                groups_per_mb = max(1, self.max_tokens // group_tokens)
            else:
                per_mb = (self.max_tokens - p) // r
                if per_mb < 1:
                    raise ValueError(f"max_tokens {self.max_tokens} cannot hold the prompt ({p}) and one response ({r})")
        if per_mb is not None and per_mb < n:
            parts = math.ceil(n / per_mb)
            # even sizes; the packer fills pieces greedily (same count, a smaller last piece)
            sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
            out = []
            for s in sizes:
                pairs, _ = group_pairs(p, [r] * s)
                out.append(MicroBatch(p + s * r, pairs, s * r, s * r, s, f"sub-group {s}/{n}"))
            return out * G
        pairs, _ = group_pairs(p, [r] * n)
        out, left = [], G
        while left:
            g = min(groups_per_mb, left)
            out.append(MicroBatch(g * group_tokens, g * pairs, g * n * r, g * n * r, g * n, f"{g} group(s)"))
            left -= g
        return out

    def _stock_micro_batches(self) -> list[MicroBatch]:
        n, p, r = self.n, self.p, self.r
        seq = p + r
        m = self.responses_per_micro_batch or n * self.groups_per_micro_batch
        if self.responses_per_micro_batch is None and self.max_tokens is not None:
            m = self.max_tokens // seq
            if m < 1:
                raise ValueError(f"max_tokens {self.max_tokens} cannot hold one sequence of P + R = {seq} tokens")
        _, pairs_one = group_pairs(p, [r])
        total, out = n * self.groups_per_step, []
        while total:
            k = min(m, total)
            out.append(MicroBatch(k * seq, k * pairs_one, k * seq, k * r, k, f"{k} sequence(s)", row_width=seq))
            total -= k
        return out

    def useful_totals(self) -> tuple[int, int, int]:
        """(tokens, attention pairs, loss edges) of the deduplicated step: one prompt per group."""
        pairs, _ = group_pairs(self.p, [self.r] * self.n)
        G = self.groups_per_step
        return G * (self.p + self.n * self.r), G * pairs, G * self.n * self.r


@dataclass(frozen=True)
class PackedStep:
    """A step as the packer made it (same interface as Workload for make_plan): every data-parallel
    rank's micro-batches in order, DualKV (packed) or the replicated bshd rows that `--no-dualkv`
    builds from the same micro-batches, and the deduplicated totals for the MFU.
    `packed_step` builds one from a packing.PackingPlan."""

    ranks: tuple  # [dp rank] -> tuple of MicroBatch
    dualkv: bool
    useful: tuple  # (tokens, attention pairs, loss edges) of the deduplicated step
    name: str = "packed rollouts"

    def micro_batches(self) -> list[MicroBatch]:
        return [mb for rank in self.ranks for mb in rank]

    def useful_totals(self) -> tuple[int, int, int]:
        return self.useful

    def label(self) -> str:
        return f"{self.name}, {'DualKV' if self.dualkv else 'stock'}"


def packed_step(records, plan, dualkv: bool, pad_to_multiple: int = 1, name: str = "packed rollouts") -> PackedStep:
    """The PackedStep of a packing.PackingPlan over `records` (RolloutGroups: only their prompt and
    response lengths are read). Stock rows as megatron.replicated builds them: one row per response,
    [prompt | response], right-padded to the micro-batch's longest row rounded up to
    pad_to_multiple (TP under sequence parallelism); DualKV micro-batches padded to it as well."""
    ranks, useful = [], [0, 0, 0]
    for rank in plan.ranks:
        mbs = []
        for pieces in rank:
            tokens = pairs = edges = 0
            rows = []
            for pc in pieces:
                rec = records[pc.record]
                p = len(rec.prompt)
                lengths = [len(rec.responses[i]) for i in pc.responses]
                tokens += p + sum(lengths)
                edges += sum(lengths)
                dedup, _ = group_pairs(p, lengths)
                pairs += dedup
                rows += [p + r for r in lengths]
            useful = [useful[0] + tokens, useful[1] + pairs, useful[2] + edges]
            if dualkv:
                padded = tokens + (-tokens) % pad_to_multiple
                mbs.append(MicroBatch(padded, pairs, edges, edges, len(rows), f"{len(pieces)} group piece(s)"))
            else:
                width = max(rows) + (-max(rows)) % pad_to_multiple
                stock_pairs = sum(group_pairs(r, [])[0] for r in rows)  # causal rows, padding not attended
                mbs.append(MicroBatch(len(rows) * width, stock_pairs, len(rows) * width, edges, len(rows),
                                      f"{len(rows)} rows x {width}", row_width=width))
        ranks.append(tuple(mbs))
    return PackedStep(tuple(ranks), dualkv, tuple(useful), name)


# ------------------------------------------------------------------------------------------------
# Activations: bytes saved for backward per token and layer
# ------------------------------------------------------------------------------------------------

def layer_activation_terms(shape: ModelShape, impl: Implementation, dualkv: bool = False) -> dict:
    """Bytes saved for backward per token of one layer, by term, before any sharding.

    `layer_bytes_per_token` shards them: the hidden-sized terms of _SEQUENCE_TERMS are divided by TP
    only under sequence parallelism (every TP rank holds them otherwise), the head- and FFN-sized
    ones always. MoE expert terms are per (token, expert) pair, multiplied by top-k here.
    """
    require_modelled(shape)
    h, d = shape.hidden_size, shape.kv_channels
    hq, hkv = shape.num_attention_heads, shape.num_query_groups
    norm_h = (8 * h + 4) if impl.norm == "composite" else (2 * h + 4)

    def qk_norm(heads: int, input_is_view: bool) -> int:
        if not shape.qk_layernorm:
            return 0
        if impl.norm == "composite":
            return 8 * heads * d + 4 * heads
        return (0 if input_is_view else 2 * heads * d) + 4 * heads

    t = {
        # attention block
        "input_norm": norm_h,  # the layer input (or its fp32 copy), rstd
        "qkv_input": 2 * h,  # normalised bf16 input of linear_qkv
        "qkv_output": 2 * (hq + 2 * hkv) * d,  # fused QKV output: K and V stay views of it
        "q_norm": qk_norm(hq, input_is_view=False),  # Megatron reshapes Q into a copy
        "k_norm": qk_norm(hkv, input_is_view=True),
        "rope_tables": 8 * d if impl.rope == "unfused" else 0,  # cos, sin (bf16) for q and for k
        "attn_qkv": 2 * (hq + hkv + (hkv if impl.attention_copies_v or dualkv else 0)) * d,  # rotated q, k (+ v copy)
        "attn_out_lse": 2 * hq * d + 4 * hq,  # output (also linear_proj's input) and fp32 LSE
        "mlp_norm": norm_h,
    }
    # Who keeps the fused QKV output (K and V are views of it) alive until backward: the fused
    # k-norm, which saves its input, that view (torch's _fused_rms_norm on CUDA, checked under
    # FakeTensorMode in tests/test_planner.py; the composite CPU norm saves a fp32 copy instead), or
    # an attention that saves V as the view (the flash-style stock attention without its own copy).
    # The DualKV core attention and the unfused stock attention copy K and V.
    k_norm_keeps_view = shape.qk_layernorm and impl.norm == "fused"
    attention_keeps_view = not dualkv and impl.stock_attention == "flash" and not impl.attention_copies_v
    if not (k_norm_keeps_view or attention_keeps_view):
        t["qkv_output"] = 0
    if not dualkv and impl.stock_attention == "unfused":
        # Megatron's DotProductAttention: repeat_interleave copies K and V to every query head, the
        # score bmm saves q and the repeated K, the context bmm the repeated V (and the probabilities:
        # per micro-batch, unfused_score_entries); no LSE. The rotated K dies (the copy's backward
        # needs no input).
        t["attn_qkv"] = 2 * 3 * hq * d
        t["attn_out_lse"] = 2 * hq * d
    if shape.is_moe:
        f, k, E = shape.moe_ffn_hidden_size, shape.moe_router_topk, shape.num_moe_experts
        t["router"] = 2 * h + 4 * E + 44 * k + 5  # input, fp32 scores, top-k probs/indices, permutation maps
        t["expert_input"] = k * (2 * h + 2)  # dispatched tokens (bf16) and their routing prob
        t["expert_mlp"] = k * (6 * f if impl.swiglu == "fused" else 12 * f)  # fc1 out, (silu, x+0, prod,) fc2 in
    else:
        f = shape.ffn_hidden_size
        t["fc1_input"] = 2 * h
        t["mlp"] = 6 * f if impl.swiglu == "fused" else 10 * f  # fc1 out 4f, (silu 2f, x+0 2f,) fc2 in 2f
    return t


_SEQUENCE_TERMS = ("input_norm", "qkv_input", "mlp_norm", "fc1_input", "router", "expert_input")


def layer_bytes_per_token(shape: ModelShape, impl: Implementation, par: Parallel, dualkv: bool = False) -> float:
    """Saved bytes per micro-batch token of one layer on one GPU (before the CP split), none recomputed."""
    t = layer_activation_terms(shape, impl, dualkv)
    tp = par.tp
    total = 0.0
    for name, v in t.items():
        if name in ("router", "expert_input", "expert_mlp"):
            # tokens are SP-sharded before routing; with etp > 1 every ETP rank holds the pair's input
            scale = par.etp if name == "expert_input" else 1
            total += v * scale / tp
        elif name in _SEQUENCE_TERMS:
            total += v / tp if par.sp else v
        else:
            total += v / tp
    return total


def unfused_score_entries(shape: ModelShape, par: Parallel, impl: Implementation, dualkv: bool,
                          mb: MicroBatch) -> int:
    """[rows, heads/TP, S, S] entries of one layer's attention scores on one GPU: what the stock
    path's unfused DotProductAttention materialises (0 for DualKV and for flash attention)."""
    if dualkv or impl.stock_attention != "unfused":
        return 0
    if par.cp > 1:
        raise ValueError("Megatron's unfused DotProductAttention does not support context parallelism (TE only)")
    if mb.row_width < 1:
        raise ValueError(f"micro-batch {mb.what!r}: the stock bshd batch needs its row width")
    return mb.responses * (shape.num_attention_heads // par.tp) * mb.row_width ** 2


def global_buffer_bytes(shape: ModelShape, par: Parallel, impl: Implementation, dualkv: bool,
                        mb: MicroBatch) -> float:
    """Megatron's global memory buffer ("mpu", bf16): allocated at the largest size asked for and kept
    for the whole run. Users: the sequence-parallel all-gather of a linear layer's input
    ([tokens/CP, hidden]) and the unfused attention's baddbmm input ([rows x heads/TP, S, S])."""
    sp_gather = 2 * shape.hidden_size * mb.tokens / par.cp if par.sp and par.tp > 1 else 0.0
    return max(sp_gather, 2.0 * unfused_score_entries(shape, par, impl, dualkv, mb))


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    shape: ModelShape
    parallel: Parallel
    workload: Workload
    recompute: str
    impl: Implementation
    hw: Hardware
    memory: dict = field(default_factory=dict)  # bytes per GPU by item (peak)
    flops: dict = field(default_factory=dict)  # per step, whole job
    time: dict = field(default_factory=dict)  # seconds per step by item (slowest DP rank)
    largest: Optional[MicroBatch] = None  # the micro-batch that sets the memory peak
    micro_batches_per_rank: int = 0
    notes: list = field(default_factory=list)

    @property
    def total_bytes(self) -> float:
        return self.memory["total"]

    def memory_gib(self) -> dict:
        return {k: v / GIB for k, v in self.memory.items()}

    @property
    def fits(self) -> bool:
        return self.memory["total"] + self.hw.reserve_gib * GIB <= self.hw.memory_gib * GIB

    @property
    def step_time_s(self) -> float:
        return self.time["step"]

    @property
    def mfu(self) -> float:
        return self.flops["useful"] / (self.step_time_s * self.hw.peak_tflops * 1e12 * self.parallel.world)

    @property
    def useful_tokens_per_s(self) -> float:
        return self.workload.useful_totals()[0] / self.step_time_s


def make_plan(shape: ModelShape, par: Parallel, work: Workload, recompute: str = "none",
              impl: Implementation = Implementation(), hw: Hardware = H100) -> Plan:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    par.check(shape)
    plan = Plan(shape, par, work, recompute, impl, hw)
    mbs = work.micro_batches()
    plan.memory, plan.largest = peak_memory(shape, par, work, recompute, impl, mbs)
    _flops_and_time(plan, mbs)
    if par.cp > 1:
        plan.notes.append("CP > 1: examples/pretrain_grpo_dualkv.py runs it with --context-parallel-size (DualKV only)"
                          if work.dualkv else "CP > 1 on the stock path needs Transformer Engine's attention")
    return plan


# -- memory ----------------------------------------------------------------------------------

def stacked_expert_bytes(shape: ModelShape, par: Parallel, impl: Implementation) -> float:
    """Implementation.experts == 'stacked': one MoE layer's local expert weights (fc1 [2F, H] and fc2
    [H, F] each, bf16) stacked and kept for backward by GroupedGemmSequentialMLP."""
    if impl.experts != "stacked" or not shape.is_moe or par.etp > 1 or not shape.gated_linear_unit:
        return 0.0
    return 2 * (shape.num_moe_experts / par.ep) * 3 * shape.hidden_size * shape.moe_ffn_hidden_size


def static_bytes(shape: ModelShape, par: Parallel) -> dict:
    """Weights (bf16), main gradients (fp32) and Adam state (fp32 master, m, v) per GPU."""
    c = shape.param_counts()
    dense = c["tp"] / par.tp + c["vocab"] / par.tp + c["replicated"]
    expert = c["expert"] / (par.ep * par.etp)
    if par.distributed_optimizer:
        opt = 12 * (dense / (par.dp * par.cp) + expert / par.expert_dp)
    else:
        opt = 12 * (dense + expert)
    return {"weights": 2 * (dense + expert), "grads": 4 * (dense + expert), "optimizer": opt,
            "params_local": dense + expert}


def _memory(shape: ModelShape, par: Parallel, work: Workload, recompute: str, impl: Implementation,
            mb: MicroBatch, buffers: Optional[float] = None) -> dict:
    """Peak bytes per GPU while `mb` runs. buffers: Megatron's global buffer, sized by the step's
    largest user (default: this micro-batch's)."""
    if buffers is None:
        buffers = global_buffer_bytes(shape, par, impl, work.dualkv, mb)
    st = static_bytes(shape, par)
    h, L, tp, cp = shape.hidden_size, shape.num_layers, par.tp, par.cp
    tokens = mb.tokens / cp  # this rank's rows
    per_layer = layer_bytes_per_token(shape, impl, par, work.dualkv) * tokens
    terms = layer_activation_terms(shape, impl, work.dualkv)
    if not work.dualkv and impl.rope == "unfused":
        # bshd: the cos/sin tables are per position, shared by the micro-batch's sequences
        per_layer -= terms["rope_tables"] / tp * tokens * (1 - 1 / max(1, mb.responses))
    if par.cp > 1 and par.cp_comm == "all_gather":
        # the attention keeps the all-gathered K and V of the whole micro-batch, not the local ones
        kv_d = shape.num_query_groups * shape.kv_channels
        per_layer -= 2 * kv_d * (2 if impl.attention_copies_v or work.dualkv else 1) / tp * tokens
        per_layer += 4 * kv_d / tp * mb.tokens
    if par.cp > 1 and par.cp_comm == "a2a":
        # the attention's saved output (its heads of every row) and linear_proj's saved input (the
        # rows after the all-to-all back) are two tensors; with the all-gather they are one
        per_layer += 2 * shape.num_attention_heads * shape.kv_channels / tp * tokens
    layer_input = (2 * h / (tp if par.sp else 1)) * tokens  # what full recomputation keeps per layer
    # Backward workspace, as fractions of one layer's saved activations (measured on the
    # CPU measurement of tests/test_planner.py: gradients of a layer's activations exist while its
    # saved tensors are released; full recomputation first rebuilds the whole layer).
    # Unfused stock attention, per layer: the bf16 probabilities (saved by the context bmm and the
    # softmax, one storage), and in backward two score-sized bf16 gradients at once (of the
    # probabilities and of the scores; the masked_fill backward makes a third as the first dies).
    scores = unfused_score_entries(shape, par, impl, work.dualkv, mb)
    if recompute == "full":
        stored_layers = L * layer_input + (4 * shape.kv_channels + 1) * tokens  # + fp32 rotary table, mask
        workspace = WORKSPACE_FULL * per_layer + (2 + 4) * scores  # the rebuilt layer, probabilities included
    else:
        saved = per_layer
        if recompute == "selective":  # core attention recomputed: its inputs are kept, output and LSE not
            if not scores:  # (the unfused attention has no LSE)
                saved -= (4 * shape.num_attention_heads / tp) * tokens
            if work.dualkv and not impl.attention_copies_v and not terms["qkv_output"]:
                # the checkpoint keeps V as Megatron made it, a view of the fused QKV output, and
                # never sees the core attention's dense copy
                d, hq, hkv = shape.kv_channels, shape.num_attention_heads, shape.num_query_groups
                saved += (2 * (hq + 2 * hkv) * d - 2 * hkv * d) / tp * tokens
            if scores:
                # the checkpoint keeps q and the rotated K instead of the repeated K and V; the
                # probabilities are rebuilt in backward
                d, hq, hkv = shape.kv_channels, shape.num_attention_heads, shape.num_query_groups
                saved -= (4 * hq * d - 2 * hkv * d) / tp * tokens
                workspace_scores = (2 + 4) * scores
            else:
                workspace_scores = 0
        else:
            saved += 2 * scores
            workspace_scores = 4 * scores
        stored_layers = L * saved
        workspace = WORKSPACE_NONE * per_layer + workspace_scores
    if shape.is_moe:
        # permuted tokens before and after the all-to-all exist at once during dispatch
        workspace += 2 * shape.moe_router_topk * 2 * h * par.etp * tokens / tp
    stack = stacked_expert_bytes(shape, par, impl)  # per MoE layer, saved like an activation
    if recompute == "full":
        workspace += stack  # only the rebuilt layer's
    else:
        stored_layers += shape.num_layers * stack

    # embedding ids, final norm, output layer input, logits
    final_norm = terms["input_norm"] / (tp if par.sp else 1) * tokens
    ids = 8 * tokens
    rows = mb.logit_rows / cp
    vocab_local = shape.vocab_size / tp
    # Bytes per [row, vocab/TP] entry, read off the code that runs (megatron_dualkv.megatron.logprobs,
    # .replicated, Megatron's GPTModel and vocab-parallel CE); the CPU peak test checks them.
    # The output layer's backward holds its bf16 logits gradient, the input gradient and a bf16
    # weight gradient (--no-gradient-accumulation-fusion: a new tensor that DDP adds to main_grad).
    weight_grad = 2 * vocab_local * h
    per_row_extra = None  # the part of `extra` that scales with the logit rows (what chunking bounds)
    if work.dualkv:
        gathered = (2 * h + 17) * rows  # gathered edge rows (bf16), targets, indices, mask
        held = (8 if impl.with_entropy else 4) * rows * vocab_local  # fp32 softmax (+ fp32 logits)
        # the logprobs' backward: softmax, zeros, -p, -p * g (16 B per entry with the held 4)
        per_row_extra = 12 * rows * vocab_local
        # ... or the output layer's backward after it (held freed): matters only for few edges
        extra = max(per_row_extra, 2 * rows * vocab_local + 2 * h * rows + weight_grad - held)
    else:
        gathered = 2 * h * rows / (tp if par.sp else 1)  # output layer input
        if impl.stock_logits == "all_rows":  # Megatron's loss: cross entropy over every row
            held = 4 * rows * vocab_local  # fp32 exp-logits
            extra = 3 * rows * vocab_local  # bf16 logits while cast (+ allocator rounding)
        else:  # our --no-dualkv baseline (replicated_logprobs): bf16 logits at every row, fp32 at the loss edges
            edges = mb.loss_edges / cp
            held = 4 * edges * vocab_local  # Megatron's vocab-parallel CE keeps fp32 softmax; TP=1: log_softmax output
            peak = max(
                # output layer backward: the [b, s, v] logits gradient and its contiguous copy (GPTModel
                # returned the [s, b, v] logits transposed, so the gradient arrives transposed) +
                # input and weight gradients; also covers the forward's [s, b, v] -> [b, s, v] copy
                4 * rows * vocab_local + 2 * h * rows + weight_grad,
                # forward: [b, s, v] logits + bf16 edge rows, their fp32 cast and its / temperature
                (2 * rows + 10 * edges) * vocab_local,
                # backward of the log-softmax (TP=1: gather's zeros + its gradient) or of the CE (in place)
                (12 if tp == 1 else 8) * edges * vocab_local,
            )
            extra = peak - held
    if impl.logits_chunk_rows is not None:  # one chunk of logits alive at a time
        base = extra if per_row_extra is None else per_row_extra
        extra = (base + held) / rows * min(rows, impl.logits_chunk_rows) if rows else 0.0
        held = 0.0
    other = final_norm + ids + gathered
    activations = stored_layers + other + held
    transient = max(extra, workspace)
    return {
        "weights": st["weights"], "grads": st["grads"], "optimizer": st["optimizer"], "buffers": buffers,
        "activations": stored_layers + other, "logits": held, "transient": transient,
        "total": st["weights"] + st["grads"] + st["optimizer"] + buffers + activations + transient,
    }


def peak_memory(shape: ModelShape, par: Parallel, work, recompute: str, impl: Implementation,
                mbs: Sequence[MicroBatch]) -> tuple[dict, MicroBatch]:
    """(memory by item, the micro-batch that sets it): the highest peak over the step's micro-batches
    (each has its own tokens, loss edges and, for the stock bshd batch, rows x width), with the
    global buffer at the size its largest user left it."""
    distinct = list(dict.fromkeys(mbs))
    buffers = max(global_buffer_bytes(shape, par, impl, work.dualkv, mb) for mb in distinct)
    best = None
    for mb in distinct:
        mem = _memory(shape, par, work, recompute, impl, mb, buffers)
        if best is None or mem["total"] > best[0]["total"]:
            best = (mem, mb)
    return best


# -- FLOPs and time --------------------------------------------------------------------------

def micro_batch_flops(shape: ModelShape, mb: MicroBatch, recompute: str = "none", logits_recomputed: bool = False) -> dict:
    """Executed FLOPs of one micro-batch (whole model, all GPUs), by item: ModelShape.step_flops
    split by kind, plus what recomputation runs again."""
    dense_tok, expert_tok = shape.token_matmul_flops_by_kind()
    matmul = MATMUL_FWD_BWD_FACTOR + (1 if recompute == "full" else 0)
    return {
        "dense": matmul * dense_tok * mb.tokens,
        "expert": matmul * expert_tok * mb.tokens,
        "logits": (MATMUL_FWD_BWD_FACTOR + (1 if logits_recomputed else 0)) * shape.logits_flops(mb.logit_rows),
        "attention": (FWD_BWD_FACTOR + (1 if recompute in ("full", "selective") else 0))
        * shape.attention_flops(mb.attention_pairs),
    }


# HBM bytes per entry of the element-wise passes (each op reads its inputs and writes its output
# once; what the GEMMs read and write is in their FLOP time), counted from the code that runs:
# DualKV logprobs [edges, vocab/TP] (megatron.logprobs): fp32 cast 6, max 4, z - max 8, exp 8, sum 4,
# normalise 8 forward; zeros 4, -p 8, * g 8, bf16 cast 6 backward.
DUALKV_LOGITS_BYTES, DUALKV_LOGITS_FWD_BYTES = 64, 38
# --no-dualkv (megatron.replicated) over every row: the [b, s, v] contiguous copy 4 forward; zeros 2
# and the transposed gradient's contiguous copy 4 backward
STOCK_ROW_BYTES = 10
# ... and at its loss edges: gather 4, fp32 cast 6, / temperature 8, then TP=1 log_softmax 12 and
# backward zeros 4 + 12 + 8 + 6 + index_put 4; TP>1 clone 8 + Megatron's CE 32, backward 8 + 8 + 6 + 4
STOCK_EDGE_BYTES = {1: 64, 2: 84}
# GPTModel's own loss over every row: fp32 cast 6, CE 32, backward 8 + 6
STOCK_ALL_ROWS_BYTES = 52
# unfused attention per score entry and layer: baddbmm write 2, masked_fill_ 4, softmax 4, context
# bmm read 2 forward; probs gradient 2, dV read 2, softmax backward 6, masked_fill backward 4, dQ and
# dK reads 4 backward
UNFUSED_SCORE_BYTES, UNFUSED_SCORE_FWD_BYTES = 30, 12


def memory_bound_bytes(plan: Plan, mb: MicroBatch) -> float:
    """HBM bytes of one micro-batch's element-wise passes on one GPU over the two largest arrays:
    the [rows, vocab/TP] logits and the unfused attention's scores (others are a few percent)."""
    shape, par, impl, rc = plan.shape, plan.parallel, plan.impl, plan.recompute
    dual = plan.workload.dualkv
    vocab_local = shape.vocab_size / par.tp
    rows, edges = mb.logit_rows / par.cp, mb.loss_edges / par.cp
    if dual:
        per = DUALKV_LOGITS_BYTES + (DUALKV_LOGITS_FWD_BYTES if impl.logits_chunk_rows is not None else 0)
        logits = per * rows * vocab_local
    elif impl.stock_logits == "edges":
        logits = (STOCK_ROW_BYTES * rows + STOCK_EDGE_BYTES[min(par.tp, 2)] * edges) * vocab_local
    else:
        logits = STOCK_ALL_ROWS_BYTES * rows * vocab_local
    scores = unfused_score_entries(shape, par, impl, dual, mb)
    per_score = UNFUSED_SCORE_BYTES + (UNFUSED_SCORE_FWD_BYTES if rc in ("full", "selective") else 0)
    return logits + per_score * shape.num_layers * scores


def _bw(hw: Hardware, spans_nodes: bool, a2a: bool = False) -> float:
    if spans_nodes:
        return hw.ib_gbps * 1e9
    return (hw.nvlink_a2a_gbps if a2a else hw.nvlink_gbps) * 1e9


def micro_batch_time(plan: Plan, mb: MicroBatch) -> dict:
    """Seconds one GPU spends on one micro-batch, by item (compute and communication, not overlapped)."""
    shape, par, hw, rc = plan.shape, plan.parallel, plan.hw, plan.recompute
    f = micro_batch_flops(shape, mb, rc, plan.impl.logits_chunk_rows is not None)
    split = par.tp * par.cp
    attn_fwd = shape.attention_flops(mb.attention_pairs)
    dual = plan.workload.dualkv
    attn_rate = (hw.dualkv_attn_tflops if dual else hw.stock_attn_tflops) * 1e12
    attn_fwd_rate = (hw.dualkv_attn_fwd_tflops if dual else hw.stock_attn_fwd_tflops) * 1e12
    recompute_attn = attn_fwd if rc in ("full", "selective") else 0.0
    t = {
        "dense": f["dense"] / split / (hw.matmul_tflops * 1e12),
        "expert": f["expert"] / split / (hw.expert_tflops * 1e12),
        "logits": f["logits"] / split / (hw.matmul_tflops * 1e12),
        "attention": (FWD_BWD_FACTOR * attn_fwd / attn_rate + recompute_attn / attn_fwd_rate) / split,
    }
    scores = unfused_score_entries(shape, par, plan.impl, dual, mb)
    if scores:
        # the local spec's two bmm multiply full S x S squares (masked and padding entries too)
        # per (row, head), 3x forward with backward, at the dense matmul rate
        passes = MATMUL_FWD_BWD_FACTOR + (1 if rc in ("full", "selective") else 0)
        t["attention"] = passes * shape.num_layers * 4 * shape.kv_channels * scores / (hw.matmul_tflops * 1e12)
    t["memory_bound"] = memory_bound_bytes(plan, mb) / (hw.hbm_gbps * 1e9)
    h, L, tokens = shape.hidden_size, shape.num_layers, mb.tokens / par.cp
    extra_fwd = 1 if rc == "full" else 0
    node = hw.gpus_per_node
    # TP: all-gather / reduce-scatter of [tokens, h] bf16 (SP), or all-reduces without SP
    tp_comm = 0.0
    if par.tp > 1:
        unit = tokens * h * 2 * (par.tp - 1) / par.tp / _bw(hw, par.tp > node)
        blocks = L * (1 if shape.is_moe else 2)
        per_block = (5 + 2 * extra_fwd) if par.sp else (4 + 2 * extra_fwd)
        tp_comm = unit * (blocks * per_block + 4)  # + embedding and output layer
    # CP: K/V all-gather forward (again when recomputed), reduce-scatter backward
    cp_comm = 0.0
    if par.cp > 1:
        spans = par.tp * par.cp > node
        if par.cp_comm == "all_gather":
            kv = mb.tokens * (par.cp - 1) / par.cp * 2 * shape.num_query_groups * shape.kv_channels / par.tp * 2
            cp_comm = L * (2 + extra_fwd) * kv / _bw(hw, spans)
        else:
            qkvo = tokens * 2 * (2 * shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels / par.tp
            cp_comm = L * (2 + extra_fwd) * qkvo * (par.cp - 1) / par.cp / _bw(hw, spans, a2a=True)
    # EP: dispatch and combine all-to-all forward, again backward (and when recomputed)
    ep_comm = 0.0
    if shape.is_moe:
        pair_bytes = tokens / par.tp * shape.moe_router_topk * h * 2  # this GPU's (token, expert) pairs
        if par.ep > 1:
            in_node = min(par.ep, max(1, node // par.etp))
            per_a2a = pair_bytes * ((in_node - 1) / par.ep / _bw(hw, False, a2a=True)
                                    + (par.ep - in_node) / par.ep / _bw(hw, True))
            ep_comm += L * (4 + 2 * extra_fwd) * per_a2a
        if par.etp > 1:  # received pairs all-gathered over expert-TP before the experts, reduce-scattered after
            ep_comm += L * (4 + 2 * extra_fwd) * pair_bytes * (par.etp - 1) / _bw(hw, par.etp > node)
    t["tp_comm"], t["cp_comm"], t["ep_comm"] = tp_comm, cp_comm, ep_comm
    t["total"] = sum(t.values())
    return t


def _step_sync_time(plan: Plan) -> dict:
    """Gradient reduction and the optimizer step, once per step (counted as not overlapped)."""
    shape, par, hw = plan.shape, plan.parallel, plan.hw
    c = shape.param_counts()
    dense = c["tp"] / par.tp + c["vocab"] / par.tp + c["replicated"]
    expert = c["expert"] / (par.ep * par.etp)
    per_param = 6 if par.distributed_optimizer else 8  # fp32 reduce-scatter + bf16 all-gather, or fp32 all-reduce
    world_spans = par.world > hw.gpus_per_node
    t = 0.0
    for params, group in ((dense, par.dp * par.cp), (expert, par.expert_dp)):
        if group > 1 and params:
            t += params * per_param * (group - 1) / group / _bw(hw, world_spans)
    shard = dense / (par.dp * par.cp if par.distributed_optimizer else 1)
    shard += expert / (par.expert_dp if par.distributed_optimizer else 1)
    optimizer = shard * 40 / (hw.hbm_gbps * 1e9)  # fp32 grad, master, m, v read and written, bf16 param written
    return {"grad_sync": t, "optimizer": optimizer}


def _flops_and_time(plan: Plan, mbs: Sequence[MicroBatch]) -> None:
    shape, par = plan.shape, plan.parallel
    executed = {"dense": 0.0, "expert": 0.0, "logits": 0.0, "attention": 0.0}
    times, cache = [], {}
    for mb in mbs:  # a step repeats a few distinct micro-batches many times
        if mb not in cache:
            cache[mb] = (micro_batch_flops(shape, mb, plan.recompute, plan.impl.logits_chunk_rows is not None),
                         micro_batch_time(plan, mb))
        f, t = cache[mb]
        for k, v in f.items():
            executed[k] += v
        times.append(t)
    loads = [0.0] * par.dp
    counts = [0] * par.dp
    per_rank = [dict.fromkeys(times[0], 0.0) for _ in range(par.dp)] if times else []
    if isinstance(plan.workload, PackedStep):  # the packer's own assignment, rank by rank
        if len(plan.workload.ranks) != par.dp:
            raise ValueError(f"the packed step has {len(plan.workload.ranks)} data-parallel ranks, the layout {par.dp}")
        owner = [r for r, rank in enumerate(plan.workload.ranks) for _ in rank]
        order = range(len(times))
    else:  # micro-batches to data-parallel ranks, longest first to the least loaded (the packer balances work)
        owner = None
        order = sorted(range(len(times)), key=lambda i: -times[i]["total"])
    for i in order:
        r = owner[i] if owner is not None else min(range(par.dp), key=lambda j: loads[j])
        loads[r] += times[i]["total"]
        counts[r] += 1
        for k, v in times[i].items():
            per_rank[r][k] += v
    slowest = max(range(par.dp), key=lambda j: loads[j])
    plan.micro_batches_per_rank = max(counts)
    plan.time = dict(per_rank[slowest]) if per_rank else {}
    plan.time["compute+comm"] = plan.time.pop("total", 0.0)
    plan.time.update(_step_sync_time(plan))
    plan.time["step"] = plan.time["compute+comm"] + plan.time["grad_sync"] + plan.time["optimizer"]
    tokens, pairs, edges = plan.workload.useful_totals()
    plan.flops = dict(executed)
    plan.flops["executed"] = sum(executed.values())
    plan.flops["useful"] = shape.step_flops(tokens, pairs, edges)


# ------------------------------------------------------------------------------------------------
# Sweep: the layouts that fit, fastest first
# ------------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, world: int, hw: Hardware = H100, max_cp: int = 16) -> list[Parallel]:
    """Every Megatron layout of `world` GPUs (PP = 1, SP on with TP) that the shape allows; TP stays
    inside a node. Expert-TP is 1 or TP (Megatron's default when --expert-tensor-parallel-size is
    not given is TP)."""
    out = []
    for tp in _divisors(world):
        if tp > hw.gpus_per_node:
            continue
        for cp in _divisors(world // tp):
            if cp > max_cp:
                continue
            dp = world // (tp * cp)
            eps = [d for d in _divisors(world) if shape.is_moe and shape.num_moe_experts % d == 0] or [1]
            for ep in eps:
                for etp in (sorted({1, tp}) if shape.is_moe else (1,)):
                    try:
                        par = Parallel(tp=tp, cp=cp, dp=dp, ep=ep, etp=etp)
                        par.check(shape)
                    except ValueError:
                        continue
                    out.append(par)
    return out


def best_plan(shape: ModelShape, par: Parallel, n: int, p: int, r: int, groups_per_step: int, dualkv: bool,
              impl: Implementation = Implementation(), hw: Hardware = H100,
              recompute_options: Sequence[str] = RECOMPUTE) -> Optional[Plan]:
    """The fastest fitting plan for one layout: for each recomputation, the biggest micro-batch that
    fits (DualKV: the fewest sub-groups, each repeating the prompt; stock: the most sequences)."""
    best = None
    for rc in recompute_options:
        for parts in range(1, n + 1):
            per_mb = math.ceil(n / parts)
            if parts > 1 and math.ceil(n / (parts - 1)) == per_mb:
                continue  # same split as the previous count
            work = Workload(n=n, p=p, r=r, groups_per_step=groups_per_step, dualkv=dualkv,
                            responses_per_micro_batch=per_mb)
            mem, _ = peak_memory(shape, par, work, rc, impl, work.micro_batches())
            if mem["total"] + hw.reserve_gib * GIB > hw.memory_gib * GIB:
                continue
            plan = make_plan(shape, par, work, rc, impl, hw)
            if best is None or plan.step_time_s < best.step_time_s:
                best = plan
            break  # more parts only repeat more prompts (DualKV) or change nothing (stock)
    return best


def sweep(shape: ModelShape, world: int, n: int, p: int, r: int, groups_per_step: int = 16,
          dualkv_options: Sequence[bool] = (True, False), impl: Implementation = Implementation(),
          hw: Hardware = H100, max_cp: int = 16, recompute_options: Sequence[str] = RECOMPUTE) -> list[Plan]:
    """The best fitting plan of every layout, DualKV and stock, fastest step first."""
    plans = []
    for par in layouts(shape, world, hw, max_cp=max_cp):
        for dualkv in dualkv_options:
            plan = best_plan(shape, par, n, p, r, groups_per_step, dualkv, impl, hw, recompute_options)
            if plan is not None:
                plans.append(plan)
    return sorted(plans, key=lambda pl: pl.step_time_s)
