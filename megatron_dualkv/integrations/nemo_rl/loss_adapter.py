"""NeMo-RL's ClippedPGLossFn on DualKV micro-batches: same options, loss, gradients and metrics.

    adapter = ClippedPGAdapter.from_config(master_config["loss_fn"])   # or .from_loss_fn(loss_fn)
    edges = EdgeBatch.gather(batch, index)                             # per-edge / per-response inputs
    loss, metrics = adapter(logprobs, edges, layout, global_valid_toks=..., global_valid_seqs=...)

The loss itself is `megatron_dualkv.loss.policy_loss`; this module maps ClippedPGLossFn's config
onto `PolicyLossConfig` and refuses what it does not implement, and computes ClippedPGLossFn's
metrics under their NeMo-RL names. Normalisers are NeMo-RL's: global_valid_toks = sum over the DP
group of token_mask[:, 1:] * sample_mask (here: the loss edges), global_valid_seqs = sum of
sample_mask. Each micro-batch's loss and metrics are its share of the global value, so sums over
micro-batches and ranks give NeMo-RL's numbers (except *_min / *_max: min / max, and
num_valid_samples, a plain count). NeMo-RL adds 1e-8 to its normalisers; this does not (a relative
difference of 1e-8 / count).

Option mapping (ClippedPGLossFn key -> PolicyLossConfig):
    ratio_clip_min -> clip_low, ratio_clip_max -> clip_high, ratio_clip_c -> dual_clip,
    reference_policy_kl_penalty -> kl_beta (0 when use_kl_in_reward), kl_input_clamp_value /
    kl_output_clamp_value -> kl_input_clamp / kl_output_clamp, use_on_policy_kl_approximation,
    use_importance_sampling_correction -> importance_correction, token_level_loss -> aggregation,
    force_on_policy_ratio -> ratio exp(lp - lp.detach()) (old logprobs unused).
Refused unless at their neutral value: reference_policy_kl_type other than "k3",
disable_ppo_ratio, sequence_level_importance_ratios (GSPO), truncated importance sampling,
use_cispo, positive_example_nll_weight, force_on_policy_ratio together with importance
correction. Unknown keys are refused unless falsy (None / False / 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from ...layout import PackedLayout
from ...loss import PolicyBatch, PolicyLossConfig, policy_loss
from .batch import EdgeIndex, NemoRLBatch

# ClippedPGLossFn's defaults for the keys this adapter implements
SUPPORTED_DEFAULTS = {
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "token_level_loss": True,
    "force_on_policy_ratio": False,
    "use_kl_in_reward": False,
}
# keys accepted only at these (neutral) values
NEUTRAL_ONLY = {
    "disable_ppo_ratio": False,
    "sequence_level_importance_ratios": False,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio_min": None,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}

METRIC_MIN = ("probs_ratio_min", "probs_ratio_clamped_min")
METRIC_MAX = ("probs_ratio_max", "probs_ratio_clamped_max")


def _is_neutral(value: Any, neutral: Any) -> bool:
    return value == neutral or (neutral in (None, False, 0.0) and not value)


@dataclass(frozen=True)
class EdgeBatch:
    """The loss inputs of one micro-batch, gathered from the NeMo-RL batch (layout order)."""

    advantages: Tensor  # [M]
    sample_mask: Tensor  # [M]
    token_mask: Tensor  # [E]
    prev_logprobs: Optional[Tensor] = None  # [E]
    generation_logprobs: Optional[Tensor] = None  # [E]
    reference_policy_logprobs: Optional[Tensor] = None  # [E]

    @staticmethod
    def gather(batch: NemoRLBatch, index: EdgeIndex, device=None) -> "EdgeBatch":
        per_edge = {k: batch.edge_values(k, index, device) if k in batch.data else None
                    for k in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs")}
        sample_mask = (batch.response_values("sample_mask", index, device) if "sample_mask" in batch.data
                       else torch.ones(index.response_row.numel(), device=device))
        return EdgeBatch(
            advantages=batch.response_values("advantages", index, device),
            sample_mask=sample_mask,
            token_mask=batch.edge_values("token_mask", index, device),
            **per_edge,
        )


class ClippedPGAdapter:
    """ClippedPGLossFn's semantics on DualKV loss edges (see the module docstring)."""

    def __init__(self, config: PolicyLossConfig, *, force_on_policy_ratio: bool = False):
        self.config = config
        self.force_on_policy_ratio = force_on_policy_ratio

    # -- construction -----------------------------------------------------------------------------
    @staticmethod
    def from_config(cfg: Mapping[str, Any]) -> "ClippedPGAdapter":
        """From a ClippedPGLossFn config (master_config["loss_fn"]; a mapping or pydantic model)."""
        if hasattr(cfg, "model_dump"):
            cfg = cfg.model_dump()
        cfg = dict(cfg)
        for key, neutral in NEUTRAL_ONLY.items():
            if key in cfg and not _is_neutral(cfg[key], neutral):
                raise ValueError(f"ClippedPGLossFn option {key}={cfg[key]!r} is not supported by the DualKV loss "
                                 f"(only {neutral!r}); turn it off or run without DualKV")
        unknown = sorted(k for k in cfg if k not in SUPPORTED_DEFAULTS and k not in NEUTRAL_ONLY and cfg[k])
        if unknown:
            raise ValueError(f"ClippedPGLossFn option(s) {unknown} are not known to the DualKV loss adapter; it "
                             f"refuses options it does not implement (supported: {sorted(SUPPORTED_DEFAULTS)})")
        c = {**SUPPORTED_DEFAULTS, **{k: v for k, v in cfg.items() if k in SUPPORTED_DEFAULTS}}
        if c["reference_policy_kl_type"] != "k3":
            raise ValueError(f"reference_policy_kl_type={c['reference_policy_kl_type']!r} is not supported by the "
                             f"DualKV loss (only 'k3')")
        if c["force_on_policy_ratio"] and c["use_importance_sampling_correction"]:
            raise ValueError("force_on_policy_ratio together with use_importance_sampling_correction is not "
                             "supported by the DualKV loss (the correction would need prev_logprobs while the "
                             "ratio ignores them)")
        config = PolicyLossConfig(
            clip_low=float(c["ratio_clip_min"]),
            clip_high=float(c["ratio_clip_max"]),
            dual_clip=None if c["ratio_clip_c"] is None else float(c["ratio_clip_c"]),
            kl_beta=0.0 if c["use_kl_in_reward"] else float(c["reference_policy_kl_penalty"]),
            kl_input_clamp=c["kl_input_clamp_value"],
            kl_output_clamp=c["kl_output_clamp_value"],
            on_policy_kl_approximation=bool(c["use_on_policy_kl_approximation"]),
            importance_correction=bool(c["use_importance_sampling_correction"]),
            aggregation="token" if c["token_level_loss"] else "sequence",
        )
        return ClippedPGAdapter(config, force_on_policy_ratio=bool(c["force_on_policy_ratio"]))

    @staticmethod
    def from_loss_fn(loss_fn: Any) -> "ClippedPGAdapter":
        """From a constructed ClippedPGLossFn (reads its attributes; a config mapping also works)."""
        if isinstance(loss_fn, Mapping) or hasattr(loss_fn, "model_dump"):
            return ClippedPGAdapter.from_config(loss_fn)
        if type(loss_fn).__name__ != "ClippedPGLossFn":
            raise ValueError(f"the DualKV worker trains with ClippedPGLossFn only, got {type(loss_fn).__name__}")
        cfg = {k: getattr(loss_fn, k) for k in list(SUPPORTED_DEFAULTS) + list(NEUTRAL_ONLY) if hasattr(loss_fn, k)}
        cfg.pop("token_level_loss", None)
        loss_type = getattr(loss_fn, "loss_type", None)
        cfg["token_level_loss"] = "SEQUENCE" not in str(loss_type).upper()
        return ClippedPGAdapter.from_config(cfg)

    # -- the loss -----------------------------------------------------------------------------------
    def policy_batch(self, edges: EdgeBatch) -> PolicyBatch:
        if not self.force_on_policy_ratio and edges.prev_logprobs is None:
            raise ValueError("the batch has no prev_logprobs (needed for the ratio unless force_on_policy_ratio)")
        return PolicyBatch(
            advantages=edges.advantages,
            old_logprobs=None if self.force_on_policy_ratio else edges.prev_logprobs,
            ref_logprobs=edges.reference_policy_logprobs,
            loss_mask=edges.token_mask,
            response_mask=edges.sample_mask,
            generation_logprobs=edges.generation_logprobs,
        )

    def __call__(self, logprobs: Tensor, edges: EdgeBatch, layout: PackedLayout, *,
                 global_valid_toks: float, global_valid_seqs: float) -> tuple[Tensor, dict[str, float]]:
        """(loss, metrics) of one micro-batch; the loss is its share of the global loss."""
        cfg = self.config
        norm = global_valid_toks if cfg.aggregation == "token" else global_valid_seqs
        batch = self.policy_batch(edges)
        if float(norm) > 0:
            loss, m = policy_loss(logprobs, batch, layout, cfg, global_num_tokens=float(global_valid_toks),
                                  global_num_responses=float(global_valid_seqs))
            kl_loss = float(m["kl_loss"])
        else:  # nothing valid in the whole step: NeMo-RL's masked mean gives 0 (0 / (0 + 1e-8))
            loss, kl_loss = (logprobs * 0).sum(), 0.0
        return loss, self.metrics(logprobs.detach(), edges, layout, float(loss.detach()), kl_loss,
                                  float(global_valid_toks))

    # -- ClippedPGLossFn's metrics ------------------------------------------------------------------
    def metrics(self, lp: Tensor, edges: EdgeBatch, layout: PackedLayout, loss: float, kl_loss: float,
                global_valid_toks: float) -> dict[str, float]:
        cfg = self.config
        f64 = lambda x: x.detach().to(torch.float64)
        w = f64(edges.token_mask).to(lp.device) * f64(edges.sample_mask).to(lp.device)[layout.edge_response]
        valid = w > 0
        zero = torch.zeros((), dtype=torch.float64, device=lp.device)
        clean = lambda x: None if x is None else torch.where(valid, f64(x).to(lp.device), zero)
        lp = clean(lp)
        prev, gen = clean(edges.prev_logprobs), clean(edges.generation_logprobs)
        G = global_valid_toks
        mean = lambda x: float((w * x).sum()) / G if G > 0 else 0.0
        extreme = lambda x, op, empty: float(op(x[valid])) if bool(valid.any()) else empty

        ratio = torch.exp(lp - lp) if self.force_on_policy_ratio else torch.exp(lp - prev)
        clamped = ratio if self.force_on_policy_ratio else ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        out = {
            "loss": loss,
            "probs_ratio": mean(ratio),
            "probs_ratio_clamped": mean(clamped),
            "probs_ratio_min": extreme(ratio, torch.min, math.inf),
            "probs_ratio_max": extreme(ratio, torch.max, -math.inf),
            "probs_ratio_clamped_min": extreme(clamped, torch.min, math.inf),
            "probs_ratio_clamped_max": extreme(clamped, torch.max, -math.inf),
            "kl_penalty": kl_loss / cfg.kl_beta if cfg.kl_beta else 0.0,
            "num_valid_samples": float(f64(edges.sample_mask).sum()),
        }
        if gen is not None:
            k3 = lambda x: torch.exp(x) - x - 1
            out["approx_entropy"] = -mean(torch.exp(lp - gen) * lp)
            if prev is not None:
                out["token_mult_prob_error"] = mean(torch.exp((gen - prev).abs() * w))
                out["gen_kl_error"] = mean(k3(prev - gen))
                out["policy_kl_error"] = mean(k3(gen - prev))
                log_mix = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
                out["js_divergence_error"] = mean(0.5 * k3(prev - log_mix) + 0.5 * k3(gen - log_mix))
                is_w = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
                out["sampling_importance_ratio"] = mean(is_w)
        return out


def reduce_metrics(per_micro_batch: list[dict[str, float]]) -> dict[str, float]:
    """Sum the micro-batches' shares (min / max for the *_min / *_max metrics)."""
    out: dict[str, float] = {}
    for m in per_micro_batch:
        for k, v in m.items():
            if k not in out:
                out[k] = v
            elif k in METRIC_MIN:
                out[k] = min(out[k], v)
            elif k in METRIC_MAX:
                out[k] = max(out[k], v)
            else:
                out[k] += v
    return out


def all_reduce_metrics(metrics: dict[str, float], group=None, device="cpu") -> dict[str, float]:
    """Reduce reduced metrics over a (data-parallel) process group with each metric's op (every
    rank must hold the same metric names: same loss config; `device`: where the backend reduces,
    e.g. the GPU for NCCL)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    out = {}
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    for k in sorted(metrics):
        op = "min" if k in METRIC_MIN else "max" if k in METRIC_MAX else "sum"
        t = torch.tensor(metrics[k], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=ops[op], group=group)
        out[k] = float(t)
    return out
