"""GRPO/DAPO policy loss over the loss edges of a packed DualKV micro-batch.

Every quantity here lives on the layout's loss edges (`PackedLayout.edge_response[e]` is the
response of edge e, `PackedLayout.response_group[m]` the group of response m): the current
logprobs [E] come from the model, the batch (`PolicyBatch`) holds per-response advantages [M] and
optional per-edge old / reference / generation logprobs and masks. Because the edges are exactly
the response tokens of the replicated batch, the loss equals the one computed on the replicated
[prompt | response] rows; the prompt is never a loss position.

Per valid edge (A = advantage of its response, r = exp(lp - lp_old)):

    pg   = max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high))       (DAPO clip-higher)
    pg   = min(pg, -A * dual_clip)            where A < 0                 (dual-clip, optional)
    pg  *= exp(lp_old - lp_gen)               (importance correction, optional; NaN/inf -> 0)
    kl   = kl_beta * clamp(k3(clamp(lp_ref - lp, +-kl_input_clamp)), +-kl_output_clamp)
           with k3(x) = exp(x) - x - 1; times exp(lp - lp_gen).detach() with on-policy KL approx.

Aggregation ("token"):    loss = sum_valid (pg + kl) / global_num_tokens
            ("sequence"): loss = sum_m response_mask_m * mean_{valid e of m} (pg + kl)_e
                                 / global_num_responses
The global normalisers are the counts over the whole (data-parallel, all micro-batches) batch:
each rank's loss is then its share and the shares sum to the global loss, so gradients
accumulated over micro-batches and all-reduced over DP equal the single-rank gradient. Get the
local counts with `count_valid`, sum them over micro-batches and ranks, pass the totals.
These are the semantics of NeMo-RL's ClippedPGLossFn (ratio_clip_min/max, ratio_clip_c, k3 KL
with clamps 20/10, use_importance_sampling_correction, use_on_policy_kl_approximation,
token_level_loss with global_valid_toks / global_valid_seqs), without its 1e-8 added to the
normaliser.

Metrics are all reducible across ranks and micro-batches: every entry is a sum or a count
(reduce with SUM), except `ratio_min` / `ratio_max` (reduce with MIN / MAX); `METRIC_REDUCTIONS`
lists the exceptions and `reduce_metrics` does the all-reduce, `summarize_metrics` turns the
reduced sums into means and fractions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from .layout import PackedLayout

Number = Union[int, float, Tensor]

AGGREGATIONS = ("token", "sequence")
ENTROPY_MODES = (None, "exact", "sampled")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Options of the clipped policy-gradient loss (defaults: GRPO, no KL, token mean)."""

    clip_low: float = 0.2  # eps_low: ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # eps_high: ratio clipped above at 1 + clip_high (DAPO: 0.28)
    dual_clip: Optional[float] = None  # c > 1: loss of a negative-advantage token capped at -A*c
    kl_beta: float = 0.0  # weight of the k3 KL to the reference policy (needs ref_logprobs)
    kl_input_clamp: Optional[float] = 20.0  # |lp_ref - lp| clamp before exp
    kl_output_clamp: Optional[float] = 10.0  # |k3| clamp
    on_policy_kl_approximation: bool = False  # weight KL by exp(lp - lp_gen), detached
    importance_correction: bool = False  # weight pg by exp(lp_old - lp_gen) (needs generation_logprobs)
    aggregation: str = "token"  # "token" or "sequence"
    entropy: Optional[str] = None  # None, "exact" (token_entropy given) or "sampled" (-w * lp)
    check_finite: bool = True  # raise on NaN/inf inputs and bad masks (one host sync per input)

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must lie in [0, 1) (ratio clipped below at 1 - clip_low), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (a bound on the ratio for negative advantages), got {self.dual_clip}")
        for name in ("kl_input_clamp", "kl_output_clamp"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.entropy not in ENTROPY_MODES:
            raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {self.entropy!r}")


@dataclass(frozen=True)
class PolicyBatch:
    """Rollout data of one micro-batch, on the layout's edges [E] and responses [M].

    old_logprobs None means on-policy: ratio = exp(lp - lp.detach()) (value 1, gradient of lp).
    loss_mask [E] (bool or 0/1 float) marks the edges that count (multi-turn: generated spans);
    response_mask [M] drops whole responses (NeMo-RL's sample_mask). Values at masked edges or
    responses are ignored, whatever they are.
    """

    advantages: Tensor  # [M]
    old_logprobs: Optional[Tensor] = None  # [E]
    ref_logprobs: Optional[Tensor] = None  # [E]
    loss_mask: Optional[Tensor] = None  # [E]
    response_mask: Optional[Tensor] = None  # [M]
    generation_logprobs: Optional[Tensor] = None  # [E]


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _edge_label(layout: PackedLayout, e: int) -> str:
    m = int(layout.edge_response[e])
    t = e - layout.response_edge_offsets[m]
    return f"{_response_label(layout, m)}, token {t} (edge {e})"


def _response_label(layout: PackedLayout, m: int) -> str:
    g = int(layout.response_group[m])
    name = layout.group_names[g]
    k = m - sum(layout.group_num_responses()[:g])
    return f"response {m} (response {k} of group {g}" + (f" '{name}'" if name is not None else "") + ")"


def _check_shape(x: Tensor, n: int, name: str, what: str) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a tensor of shape [{n}] ({what}), got {type(x).__name__}")
    if tuple(x.shape) != (n,):
        raise ValueError(f"{name}: expected shape [{n}] ({what}), got {list(x.shape)}")


def _check_finite(x: Tensor, valid: Tensor, name: str, layout: Union[PackedLayout, Tensor], per_edge: bool) -> None:
    bad = valid & ~torch.isfinite(x)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        if isinstance(layout, Tensor):  # group ids [M]
            where = f"response {i} (group {int(layout[i])})"
        else:
            where = _edge_label(layout, i) if per_edge else _response_label(layout, i)
        n = int(bad.sum())
        raise ValueError(f"{name} has a non-finite value {float(x[i])} at {where} ({n} non-finite in all)")


def _masks(batch: PolicyBatch, layout: PackedLayout, dtype: torch.dtype, check: bool = True) -> tuple[Tensor, Tensor]:
    """(edge weight [E], response weight [M]) as `dtype`, 0 where an edge or response is dropped."""
    E, M = layout.num_edges, layout.num_responses
    if batch.response_mask is not None:
        _check_shape(batch.response_mask, M, "response_mask", "one per response")
        resp = batch.response_mask.to(layout.device, dtype)
    else:
        resp = torch.ones(M, dtype=dtype, device=layout.device)
    if batch.loss_mask is not None:
        _check_shape(batch.loss_mask, E, "loss_mask", "one per loss edge")
        edge = batch.loss_mask.to(layout.device, dtype)
    else:
        edge = torch.ones(E, dtype=dtype, device=layout.device)
    for name, w in (("loss_mask", edge), ("response_mask", resp)) if check else ():
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError(f"{name} must hold finite non-negative weights (bool or 0/1)")
    return edge * resp[layout.edge_response], resp


def count_valid(batch: PolicyBatch, layout: PackedLayout) -> dict[str, Tensor]:
    """Local normalisers of this micro-batch: {'num_tokens', 'num_responses'} (float64 scalars).

    Sum them over every micro-batch and data-parallel rank of the step to get the
    `global_num_tokens` / `global_num_responses` that `policy_loss` takes.
    """
    edge, resp = _masks(batch, layout, torch.float64)
    return {"num_tokens": edge.sum(), "num_responses": resp.sum()}


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, input_clamp: Optional[float] = 20.0,
          output_clamp: Optional[float] = 10.0) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(x) - x - 1, x = lp_ref - lp."""
    x = ref_logprobs - logprobs
    if input_clamp is not None:
        x = x.clamp(-input_clamp, input_clamp)
    kl = torch.exp(x) - x - 1.0
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Exact entropy [E] of the next-token distribution at each loss edge from full-vocab logits
    [E, V] (no tensor parallelism; under vocab-parallel logits sum p*log p over the shards)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _as_normaliser(x: Optional[Number], local: Tensor, name: str) -> Tensor:
    if x is None:
        if not float(local) > 0:
            raise ValueError(f"this micro-batch has nothing to average over (every edge or response is masked) "
                             f"and no {name} was given")
        x = local
    v = torch.as_tensor(x, dtype=torch.float64)
    if v.numel() != 1 or not bool(torch.isfinite(v)) or not float(v) > 0:
        raise ValueError(f"{name} must be a positive finite count (the sum over all ranks and micro-batches), got {x}")
    if float(v) < float(local) * (1 - 1e-9):
        raise ValueError(f"{name}={float(v)} is smaller than this micro-batch's own count {float(local)}")
    return v


def policy_loss(
    logprobs: Tensor,
    batch: PolicyBatch,
    layout: PackedLayout,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    global_num_tokens: Optional[Number] = None,
    global_num_responses: Optional[Number] = None,
    token_entropy: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO/DAPO loss of one micro-batch: (loss, metrics).

    logprobs: [E] current-policy logprobs at the layout's loss edges (with autograd).
    global_num_tokens / global_num_responses: normaliser of the "token" / "sequence" aggregation,
    summed over the whole step (see `count_valid`); None = this micro-batch alone.
    token_entropy: [E] exact per-edge entropies, needed by config.entropy == "exact".
    """
    E, M = layout.num_edges, layout.num_responses
    _check_shape(logprobs, E, "logprobs", "one per loss edge")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be floating point, got {logprobs.dtype}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    dev = logprobs.device
    if layout.device != dev:
        raise ValueError(f"logprobs are on {dev} but the layout is on {layout.device}")
    _check_shape(batch.advantages, M, "advantages", "one per response")

    def edge_input(x: Optional[Tensor], name: str, needed_by: Optional[str] = None) -> Optional[Tensor]:
        if x is None:
            if needed_by is not None:
                raise ValueError(f"{name} is required by {needed_by}")
            return None
        _check_shape(x, E, name, "one per loss edge")
        return x.to(dev, dtype)

    edge_w, resp_w = _masks(batch, layout, dtype, check=config.check_finite)
    valid_edge, valid_resp = edge_w > 0, resp_w > 0
    old = edge_input(batch.old_logprobs, "old_logprobs")
    ref = edge_input(batch.ref_logprobs, "ref_logprobs", "kl_beta != 0" if config.kl_beta != 0 else None)
    needs_gen = ("importance_correction" if config.importance_correction else
                 "on_policy_kl_approximation" if config.on_policy_kl_approximation and config.kl_beta != 0 else None)
    gen = edge_input(batch.generation_logprobs, "generation_logprobs", needs_gen)
    adv = batch.advantages.to(dev, dtype)
    if config.entropy == "exact":
        if token_entropy is None:
            raise ValueError("config.entropy == 'exact' needs token_entropy [E] (see entropy_from_logits)")
        _check_shape(token_entropy, E, "token_entropy", "one per loss edge")
    if config.check_finite:
        _check_finite(adv, valid_resp, "advantages", layout, per_edge=False)
        for name, x in (("logprobs", logprobs), ("old_logprobs", old), ("ref_logprobs", ref),
                        ("generation_logprobs", gen)):
            if x is not None:
                _check_finite(x.detach(), valid_edge, name, layout, per_edge=True)

    local = {"num_tokens": edge_w.detach().double().sum(), "num_responses": resp_w.detach().double().sum()}
    if config.aggregation == "token":
        norm = _as_normaliser(global_num_tokens, local["num_tokens"], "global_num_tokens")
    else:
        norm = _as_normaliser(global_num_responses, local["num_responses"], "global_num_responses")

    # Masked edges/responses may hold anything: replace them before any arithmetic so that a NaN
    # there cannot reach the sums (0 * NaN is NaN).
    zero = torch.zeros((), dtype=dtype, device=dev)
    fill = lambda x: None if x is None else torch.where(valid_edge, x, zero)
    lp = torch.where(valid_edge, logprobs.to(dtype), zero)
    old, ref, gen = fill(old), fill(ref), fill(gen)
    adv_e = torch.where(valid_edge, adv[layout.edge_response], zero)

    ratio = torch.exp(lp - (lp.detach() if old is None else old))
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    pg = torch.maximum(-adv_e * ratio, -adv_e * clipped)
    if config.dual_clip is not None:
        pg = torch.where(adv_e < 0, torch.minimum(pg, -adv_e * config.dual_clip), pg)
    if config.importance_correction:
        is_w = torch.exp((lp.detach() if old is None else old) - gen)
        is_w = torch.nan_to_num(is_w, nan=0.0, posinf=0.0, neginf=0.0)
        pg = pg * is_w
    # the KL is logged whenever reference logprobs are given, and enters the loss if kl_beta != 0
    kl_tok = None if ref is None else k3_kl(lp, ref, config.kl_input_clamp, config.kl_output_clamp)
    if config.kl_beta != 0:
        kl_w = torch.ones_like(kl_tok)
        if config.on_policy_kl_approximation:
            kl_w = torch.nan_to_num(torch.exp(lp - gen).detach(), nan=0.0, posinf=0.0, neginf=0.0)
        kl = config.kl_beta * kl_w * kl_tok
    else:
        kl = torch.zeros_like(pg)

    norm_t = norm.to(dev, dtype)
    if config.aggregation == "token":
        pg_loss = (pg * edge_w).sum() / norm_t
        kl_loss = (kl * edge_w).sum() / norm_t
    else:
        def seq_mean(x: Tensor) -> Tensor:
            num = torch.zeros(M, dtype=dtype, device=dev).index_add(0, layout.edge_response, x * edge_w)
            den = torch.zeros(M, dtype=dtype, device=dev).index_add(0, layout.edge_response, edge_w)
            # a response with no valid token contributes 0 (it still counts in the normaliser)
            per_resp = torch.where(den > 0, num / den.clamp_min(torch.finfo(dtype).tiny), zero)
            return (per_resp * resp_w).sum() / norm_t
        pg_loss = seq_mean(pg)
        kl_loss = seq_mean(kl)
    loss = pg_loss + kl_loss

    with torch.no_grad():
        metrics = _metrics(config, edge_w, valid_edge, ratio, adv_e, lp, old, gen, kl_tok,
                           token_entropy, local, pg_loss, kl_loss, loss)
    return loss, metrics


def _metrics(config, edge_w, valid, ratio, adv_e, lp, old, gen, kl_tok, token_entropy, local,
             pg_loss, kl_loss, loss) -> dict[str, Tensor]:
    f64 = lambda x: x.detach().to(torch.float64)
    w = f64(edge_w)
    r = f64(ratio)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=r.device)
    # A clip "binds" where it zeroes the token's gradient: above 1+eps_high with A > 0, below
    # 1-eps_low with A < 0, and (dual-clip) above c with A < 0.
    hi = valid & (adv_e > 0) & (ratio > 1.0 + config.clip_high)
    lo = valid & (adv_e < 0) & (ratio < 1.0 - config.clip_low)
    out = {
        "loss": f64(loss), "pg_loss": f64(pg_loss), "kl_loss": f64(kl_loss),
        "num_tokens": local["num_tokens"], "num_responses": local["num_responses"],
        "clip_high_count": (w * hi).sum(), "clip_low_count": (w * lo).sum(),
        "ratio_sum": (w * r).sum(),
        "ratio_min": torch.where(valid, r, inf).min() if r.numel() else inf,
        "ratio_max": torch.where(valid, r, -inf).max() if r.numel() else -inf,
    }
    if config.dual_clip is not None:
        dual = valid & (adv_e < 0) & (ratio > config.dual_clip)
        out["dual_clip_count"] = (w * dual).sum()
    if kl_tok is not None:
        out["kl_sum"] = (w * f64(kl_tok)).sum()
    if config.importance_correction:
        is_w = torch.nan_to_num(torch.exp((lp if old is None else old) - gen), nan=0.0, posinf=0.0, neginf=0.0)
        out["is_weight_sum"] = (w * f64(is_w)).sum()
    if config.entropy == "exact":
        ent = torch.where(valid, token_entropy.detach().to(lp.device, torch.float64), 0.0)
        out["entropy_sum"] = (w * ent).sum()
    elif config.entropy == "sampled":
        # -E_gen[(pi/pi_gen) log pi]: unbiased for the entropy when tokens were sampled from pi_gen
        base = gen if gen is not None else (old if old is not None else lp)
        out["entropy_sum"] = (w * f64(-torch.exp(lp - base) * lp)).sum()
    return out


# --------------------------------------------------------------------------------------------
# Reducing metrics across ranks / micro-batches
# --------------------------------------------------------------------------------------------

METRIC_REDUCTIONS = {"ratio_min": "min", "ratio_max": "max"}  # every other metric: sum


def accumulate_metrics(into: Optional[dict[str, Tensor]], metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """Combine the metrics of two micro-batches (sum, or min/max where METRIC_REDUCTIONS says)."""
    if into is None:
        return {k: v.clone() for k, v in metrics.items()}
    for k, v in metrics.items():
        op = METRIC_REDUCTIONS.get(k, "sum")
        into[k] = torch.minimum(into[k], v) if op == "min" else torch.maximum(into[k], v) if op == "max" else into[k] + v
    return into


def reduce_metrics(metrics: dict[str, Tensor], group=None) -> dict[str, Tensor]:
    """All-reduce the metrics over a process group (in place) with each metric's own op."""
    import torch.distributed as dist
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    for k in sorted(metrics):
        dist.all_reduce(metrics[k], op=ops[METRIC_REDUCTIONS.get(k, "sum")], group=group)
    return metrics


def summarize_metrics(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Means and fractions for logging, from (reduced) sums and counts."""
    n = float(metrics["num_tokens"])
    per_tok = lambda k: float(metrics[k]) / n if n > 0 else float("nan")
    out = {
        "loss": float(metrics["loss"]), "pg_loss": float(metrics["pg_loss"]), "kl_loss": float(metrics["kl_loss"]),
        "num_tokens": n, "num_responses": float(metrics["num_responses"]),
        "clip_high_fraction": per_tok("clip_high_count"), "clip_low_fraction": per_tok("clip_low_count"),
        "ratio_mean": per_tok("ratio_sum"),
        "ratio_min": float(metrics["ratio_min"]), "ratio_max": float(metrics["ratio_max"]),
    }
    for k, name in (("dual_clip_count", "dual_clip_fraction"), ("kl_sum", "kl_mean"),
                    ("is_weight_sum", "is_weight_mean"), ("entropy_sum", "entropy_mean")):
        if k in metrics:
            out[name] = per_tok(k)
    return out


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------

BASELINES = ("mean", "leave_one_out")


def group_advantages(
    rewards: Tensor,
    groups: Union[PackedLayout, Tensor],
    *,
    baseline: str = "mean",
    normalize_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
    valid: Optional[Tensor] = None,
) -> Tensor:
    """Per-response advantages [M] from rewards [M], normalised within each group.

    groups: a PackedLayout (its response_group) or group ids [M] (int, any order). Compute them
    over the whole rollout batch, before packing: a packer that splits a large group over
    micro-batches would leave each micro-batch's layout with only part of the group.
    baseline "mean":          A_m = r_m - mean of the group          (GRPO; Dr. GRPO without std)
             "leave_one_out": A_m = r_m - mean of the OTHER responses (RLOO)
    normalize_std: divide by (std + eps), the std of the rewards the baseline was taken from
    (the whole group for "mean" -- GRPO; the other responses for "leave_one_out" -- as NeMo-RL).
    Zero std (every reward of those equal): the advantage is left unscaled, never divided by eps;
    with the "mean" baseline it is then 0, so groups that all succeed or all fail give no signal.
    A group with fewer than 2 valid responses gets advantage 0 (no baseline to compare with),
    as do invalid responses (`valid` [M] bool, default all):
    they are excluded from every group statistic.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if isinstance(groups, PackedLayout):
        M, grp = groups.num_responses, groups.response_group
    else:
        if not isinstance(groups, Tensor) or groups.dim() != 1 or groups.is_floating_point():
            raise ValueError("groups must be a PackedLayout or a 1-D integer tensor of group ids [M]")
        M, grp = groups.numel(), groups
        if M and int(grp.min()) < 0:
            raise ValueError(f"group ids must be >= 0, got {int(grp.min())}")
    _check_shape(rewards, M, "rewards", "one per response")
    dtype = torch.promote_types(rewards.dtype, torch.float32) if rewards.is_floating_point() else torch.float32
    dev = rewards.device
    w = torch.ones(M, dtype=dtype, device=dev)
    if valid is not None:
        _check_shape(valid, M, "valid", "one per response")
        w = valid.to(dev, dtype)
        if bool(((w != 0) & (w != 1)).any()):
            raise ValueError("valid must be a boolean (or 0/1) mask over responses")
    r = rewards.to(dtype)
    _check_finite(r, w > 0, "rewards", groups, per_edge=False)
    r = torch.where(w > 0, r, torch.zeros((), dtype=dtype, device=dev))

    grp = grp.to(dev, torch.int64)
    G = int(grp.max()) + 1 if M else 0
    sums = lambda x: torch.zeros(G, dtype=dtype, device=dev).index_add(0, grp, x)
    n = sums(w)
    mu = sums(w * r) / n.clamp_min(1)  # group mean over valid responses
    ss = sums(w * (r - mu[grp]) ** 2)  # centred sum of squares
    n_m, mu_m, ss_m = n[grp], mu[grp], ss[grp]
    if baseline == "mean":
        k = n_m
        b = mu_m
        sq = ss_m
    else:
        # statistics of the others: remove response m from the group's sums (exact algebra on
        # centred quantities, so equal rewards give exactly zero spread)
        k = n_m - w
        b = (n_m * mu_m - w * r) / k.clamp_min(1)
        terms = (ss_m, n_m * (mu_m - b) ** 2, w * (r - b) ** 2)
        sq = terms[0] + terms[1] - terms[2]
        # The subtraction cancels: a spread below its rounding error (all others equal) is zero,
        # not a tiny number that the std normalisation would blow up.
        noise = 16 * torch.finfo(dtype).eps * (terms[0] + terms[1] + terms[2])
        sq = torch.where(sq > noise, sq, torch.zeros_like(sq))
    adv = r - b
    if normalize_std:
        dof = k - (1 if unbiased_std else 0)
        std = torch.where(dof > 0, (sq / dof.clamp_min(1)).sqrt(), torch.zeros_like(sq))
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return torch.where((w > 0) & (n_m >= 2), adv, torch.zeros_like(adv))
