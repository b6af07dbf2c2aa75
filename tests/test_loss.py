"""GRPO/DAPO loss over DualKV loss edges against the same loss on the replicated batch.

The replicated reference below is written independently of megatron_dualkv.loss: each response
is its own right-padded [prompt | response] row, in NeMo-RL's data convention (logprobs[:, c] =
log p(token c | tokens < c), column 0 unused, token_mask on generated tokens, sample_mask per
row), and follows ClippedPGLossFn's documented formula including its masked_mean(+1e-8).
"""

import math

import pytest
import torch

from megatron_dualkv import build_layout
from megatron_dualkv.loss import (
    PolicyBatch,
    PolicyLossConfig,
    accumulate_metrics,
    count_valid,
    entropy_from_logits,
    group_advantages,
    k3_kl,
    policy_loss,
    reduce_metrics,
    summarize_metrics,
)

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# A random rollout micro-batch, in both representations
# --------------------------------------------------------------------------------------------


def make_groups(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, rs in shapes:
        prompt = torch.randint(1, 100, (p,), generator=g).tolist()
        out.append((prompt, [torch.randint(1, 100, (r,), generator=g).tolist() for r in rs]))
    return out


SHAPES = [(5, [3, 1, 4, 2]), (2, [6, 2]), (7, [1, 3, 5])]  # several P and R_i, R_i = 1 included
SEED = 1  # test_the_rollout_exercises_every_clip_branch checks this rollout hits every clip


def make_rollout(groups, seed=0, multi_turn=True, drop_response=True, spread=1.0):
    """Per-edge data [E] and per-response data [M], edges in response-major token order."""
    g = torch.Generator().manual_seed(seed)
    lens = [len(r) for _, rs in groups for r in rs]
    E, M = sum(lens), len(lens)
    old = -torch.rand(E, generator=g, dtype=F64) * 3 - 0.05
    data = {
        "lp": old + spread * torch.randn(E, generator=g, dtype=F64),  # ratios ~ 0.1 .. 10: every clip binds somewhere
        "old": old,
        "ref": old + 0.5 * torch.randn(E, generator=g, dtype=F64),
        "gen": old + 0.3 * torch.randn(E, generator=g, dtype=F64),
        "adv": torch.randn(M, generator=g, dtype=F64),
        "loss_mask": torch.ones(E, dtype=torch.bool),
        "response_mask": torch.ones(M, dtype=torch.bool),
    }
    if multi_turn:
        # mask a span inside some responses (tool output in a multi-turn rollout)
        off = 0
        for n in lens:
            if n >= 4:
                data["loss_mask"][off + 1: off + 3] = False
            off += n
    if drop_response:
        data["response_mask"][1] = False
    return data


def to_batch(d, old=True, ref=True, gen=True):
    return PolicyBatch(
        advantages=d["adv"], old_logprobs=d["old"] if old else None, ref_logprobs=d["ref"] if ref else None,
        loss_mask=d["loss_mask"], response_mask=d["response_mask"], generation_logprobs=d["gen"] if gen else None,
    )


def to_replicated(groups, d, lp):
    """NeMo-RL style [B, S] tensors: one row per response, right-padded. `lp` [E] is scattered
    into the rows with autograd, so gradients flow back to the edge tensor."""
    rows = [(p, r) for p, rs in groups for r in rs]
    B, S = len(rows), max(len(p) + len(r) for p, r in rows)
    cols, row_idx = [], []
    for b, (p, r) in enumerate(rows):
        cols += list(range(len(p), len(p) + len(r)))  # column of each response token
        row_idx += [b] * len(r)
    idx = (torch.tensor(row_idx), torch.tensor(cols))

    def scatter(x, fill=0.0):
        out = torch.full((B, S), fill, dtype=x.dtype)
        return out.index_put(idx, x)

    return {
        "curr": torch.zeros(B, S, dtype=F64).index_put(idx, lp),
        "prev_logprobs": scatter(d["old"]),
        "reference_policy_logprobs": scatter(d["ref"]),
        "generation_logprobs": scatter(d["gen"]),
        "token_mask": scatter(d["loss_mask"].to(F64)),
        "sample_mask": d["response_mask"].to(F64),
        "advantages": d["adv"][:, None].expand(B, S).clone(),
        "index": idx,
    }


def masked_mean(v, mask, dim=None, global_norm=None):
    norm = mask.sum(dim) if global_norm is None else global_norm
    return (v * mask).sum(dim) / (norm + 1e-8)


def replicated_loss(rep, cfg, global_valid_toks, global_valid_seqs):
    """The clipped PG loss on the replicated rows, as NeMo-RL's ClippedPGLossFn defines it."""
    sl = lambda k: rep[k][:, 1:]
    token_mask, sample_mask = sl("token_mask"), rep["sample_mask"]
    mask = token_mask * sample_mask[:, None]
    curr, prev, gen, ref, adv = sl("curr"), sl("prev_logprobs"), sl("generation_logprobs"), sl("reference_policy_logprobs"), sl("advantages")
    if cfg.get("on_policy"):
        prev = curr.detach()
    token_level = cfg.get("token_level", True)

    def aggregate(x):
        if token_level:
            return masked_mean(x, mask, global_norm=global_valid_toks)
        return masked_mean(masked_mean(x, token_mask, dim=-1), sample_mask, global_norm=global_valid_seqs)

    beta = cfg.get("beta", 0.0)
    logr = (ref - curr).clamp(-20, 20)
    k3 = (torch.exp(logr) - 1 - logr).clamp(-10, 10)
    if beta:
        w = torch.exp(curr - gen).detach().nan_to_num(0, 0, 0) if cfg.get("on_policy_kl") else torch.ones_like(curr)
        kl = aggregate(w * beta * k3)
    else:
        kl = torch.zeros((), dtype=F64)
    ratios = torch.exp(curr - prev)
    clamped = ratios.clamp(1 - cfg["eps_low"], 1 + cfg["eps_high"])
    clip_loss = torch.max(-adv * ratios, -adv * clamped)
    if cfg.get("c") is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * cfg["c"]), clip_loss)
    isw = torch.exp(prev - gen).nan_to_num(0, 0, 0) if cfg.get("is") else torch.ones_like(curr)
    actor = aggregate(isw * clip_loss)
    m = mask.bool()
    metrics = {
        "ratio_mean": masked_mean(ratios.detach(), mask).item(),
        "ratio_min": ratios.detach()[m].min().item(), "ratio_max": ratios.detach()[m].max().item(),
        "clip_high": ((adv > 0) & (ratios > 1 + cfg["eps_high"]))[m].sum().item(),
        "clip_low": ((adv < 0) & (ratios < 1 - cfg["eps_low"]))[m].sum().item(),
        "num_tokens": mask.sum().item(),
        "kl_mean": masked_mean(k3.detach(), mask).item(),  # logged even when beta = 0
    }
    return actor + kl, metrics


CASES = {
    # name: (PolicyLossConfig kwargs, replicated-reference cfg)
    "grpo": (dict(), dict(eps_low=0.2, eps_high=0.2)),
    "clip_higher": (dict(clip_low=0.2, clip_high=0.28), dict(eps_low=0.2, eps_high=0.28)),
    "dual_clip": (dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0), dict(eps_low=0.2, eps_high=0.28, c=3.0)),
    "k3_kl": (dict(kl_beta=0.05), dict(eps_low=0.2, eps_high=0.2, beta=0.05)),
    "importance": (dict(clip_high=0.28, importance_correction=True, kl_beta=0.1, on_policy_kl_approximation=True),
                   dict(eps_low=0.2, eps_high=0.28, beta=0.1, is_=True, on_policy_kl=True)),
}


def _ref_cfg(ref_cfg, aggregation):
    cfg = dict(ref_cfg)
    cfg["is"] = cfg.pop("is_", False)
    cfg["token_level"] = aggregation == "token"
    return cfg


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_the_replicated_batch(case, aggregation):
    groups = make_groups(1, SHAPES)
    layout = build_layout(groups)
    d = make_rollout(groups, seed=SEED)
    kwargs, ref_cfg = CASES[case]
    cfg = PolicyLossConfig(aggregation=aggregation, **kwargs)
    counts = count_valid(to_batch(d), layout)

    lp = d["lp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, to_batch(d), layout, cfg,
                                global_num_tokens=counts["num_tokens"], global_num_responses=counts["num_responses"])
    loss.backward()

    lp_ref = d["lp"].clone().requires_grad_(True)
    rep = to_replicated(groups, d, lp_ref)
    ref_loss, ref_metrics = replicated_loss(rep, _ref_cfg(ref_cfg, aggregation),
                                            rep["token_mask"][:, 1:].mul(rep["sample_mask"][:, None]).sum(),
                                            rep["sample_mask"].sum())
    ref_loss.backward()

    assert loss.item() != 0.0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=0)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-7, atol=1e-12)
    # masked edges and the dropped response get no gradient; some valid ones do
    dead = ~d["loss_mask"] | ~d["response_mask"][layout.edge_response]
    assert dead.any() and (lp.grad[dead] == 0).all() and (lp.grad[~dead] != 0).any()

    s = summarize_metrics(metrics)
    assert s["num_tokens"] == ref_metrics["num_tokens"] == int((~dead).sum())
    assert s["clip_high_fraction"] * s["num_tokens"] == ref_metrics["clip_high"]
    assert s["clip_low_fraction"] * s["num_tokens"] == ref_metrics["clip_low"]
    assert math.isclose(s["ratio_mean"], ref_metrics["ratio_mean"], rel_tol=1e-7)
    assert s["ratio_min"] == pytest.approx(ref_metrics["ratio_min"], rel=1e-12)
    assert s["ratio_max"] == pytest.approx(ref_metrics["ratio_max"], rel=1e-12)
    assert math.isclose(s["kl_mean"], ref_metrics["kl_mean"], rel_tol=1e-7)
    assert s["loss"] == pytest.approx(loss.item(), rel=1e-12)
    assert s["pg_loss"] + s["kl_loss"] == pytest.approx(loss.item(), rel=1e-12)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_fractional_mask_weights_match_the_replicated_batch(aggregation):
    """Non-binary token / sample weights act as NeMo-RL's token_mask * sample_mask do."""
    groups = make_groups(1, SHAPES)
    layout = build_layout(groups)
    d = make_rollout(groups, seed=SEED)
    g = torch.Generator().manual_seed(3)
    d["loss_mask"] = d["loss_mask"] * torch.rand(layout.num_edges, generator=g, dtype=F64)
    d["response_mask"] = d["response_mask"] * (0.5 + torch.rand(layout.num_responses, generator=g, dtype=F64))
    cfg = PolicyLossConfig(clip_high=0.28, kl_beta=0.05, aggregation=aggregation)
    lp = d["lp"].clone().requires_grad_(True)
    loss, _ = policy_loss(lp, to_batch(d), layout, cfg)
    loss.backward()
    lp_ref = d["lp"].clone().requires_grad_(True)
    rep = to_replicated(groups, d, lp_ref)
    ref_loss, _ = replicated_loss(rep, _ref_cfg(CASES["k3_kl"][1] | dict(eps_high=0.28), aggregation),
                                  (rep["token_mask"][:, 1:] * rep["sample_mask"][:, None]).sum(), rep["sample_mask"].sum())
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=0)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-7, atol=1e-12)


def test_the_rollout_exercises_every_clip_branch():
    """Guards the equality test above: with these inputs each clip binds on some tokens."""
    groups = make_groups(1, SHAPES)
    layout = build_layout(groups)
    d = make_rollout(groups, seed=SEED)
    _, m = policy_loss(d["lp"], to_batch(d), layout, PolicyLossConfig(clip_high=0.28, dual_clip=3.0))
    assert m["clip_high_count"] > 0 and m["clip_low_count"] > 0 and m["dual_clip_count"] > 0
    assert m["clip_high_count"] + m["clip_low_count"] < m["num_tokens"]


def test_hand_computed_clips_and_their_gradients():
    # one group, four one-token responses: A = +1, -1, +1, -1 with ratios 1.5, 0.5, 0.9, 5
    layout = build_layout([([1, 2], [[3], [4], [5], [6]])])
    old = torch.full((4,), -1.0, dtype=F64)
    ratios = torch.tensor([1.5, 0.5, 0.9, 5.0], dtype=F64)
    lp = (old + ratios.log()).requires_grad_(True)
    batch = PolicyBatch(advantages=torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64), old_logprobs=old)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, m = policy_loss(lp, batch, layout, cfg)
    loss.backward()
    # -1.28 (capped at 1+eps_high), 0.8 (capped at 1-eps_low), -0.9 (inside), 3 (dual clip c)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 0.9 + 3.0) / 4, rel=1e-12)
    # only the unclipped token has a gradient: d(-A r)/dlp = -A r, over 4 tokens
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 0.0, -0.9 / 4, 0.0], dtype=F64))
    assert (m["clip_high_count"], m["clip_low_count"], m["dual_clip_count"]) == (1, 1, 1)
    assert (m["ratio_min"].item(), m["ratio_max"].item()) == pytest.approx((0.5, 5.0))

    # metrics see only valid edges: masking the two low-ratio tokens leaves min 1.5
    _, mm = policy_loss(lp, PolicyBatch(batch.advantages, old, loss_mask=torch.tensor([True, False, False, True])),
                        layout, cfg)
    assert (mm["ratio_min"].item(), mm["num_tokens"].item(), mm["clip_low_count"].item()) == pytest.approx((1.5, 2, 0))

    # swapping eps_low and eps_high changes the loss: -1.2 and 0.72 instead of -1.28 and 0.8
    swapped, _ = policy_loss(lp, batch, layout, PolicyLossConfig(clip_low=0.28, clip_high=0.2, dual_clip=3.0))
    assert swapped.item() == pytest.approx((-1.2 + 0.72 - 0.9 + 3.0) / 4, rel=1e-12)
    # without dual clip the last token costs its full -A r = 5
    no_dual, _ = policy_loss(lp, batch, layout, PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    assert no_dual.item() == pytest.approx((-1.28 + 0.8 - 0.9 + 5.0) / 4, rel=1e-12)


def test_on_policy_ratio_is_one_and_gives_the_policy_gradient():
    groups = make_groups(3, SHAPES)
    layout = build_layout(groups)
    d = make_rollout(groups, seed=4, multi_turn=False, drop_response=False)
    lp = d["lp"].clone().requires_grad_(True)
    loss, m = policy_loss(lp, PolicyBatch(advantages=d["adv"]), layout, PolicyLossConfig())
    loss.backward()
    adv_e = d["adv"][layout.edge_response]
    E = layout.num_edges
    assert loss.item() == pytest.approx(-adv_e.mean().item(), rel=1e-12)
    torch.testing.assert_close(lp.grad, -adv_e / E)
    assert m["ratio_min"] == 1 and m["ratio_max"] == 1 and m["clip_high_count"] == 0


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_global_normaliser_split_over_two_ranks_sums_to_the_single_rank_loss(aggregation):
    groups = make_groups(5, SHAPES + [(3, [2, 2, 2])])
    d = make_rollout(groups, seed=6)
    cfg = PolicyLossConfig(clip_high=0.28, dual_clip=3.0, kl_beta=0.02, aggregation=aggregation)
    full = build_layout(groups)
    lp_full = d["lp"].clone().requires_grad_(True)
    loss_full, m_full = policy_loss(lp_full, to_batch(d), full, cfg)
    loss_full.backward()

    # rank 0 gets groups 0 and 3, rank 1 groups 1 and 2; data sliced by edge / response ranges
    eoff, roff = [0], [0]
    for _, rs in groups:
        eoff.append(eoff[-1] + sum(map(len, rs)))
        roff.append(roff[-1] + len(rs))
    parts = []
    for gids in ([0, 3], [1, 2]):
        es = torch.cat([torch.arange(eoff[g], eoff[g + 1]) for g in gids])
        rs = torch.cat([torch.arange(roff[g], roff[g + 1]) for g in gids])
        sub = {k: (v[rs] if k in ("adv", "response_mask") else v[es]) for k, v in d.items()}
        parts.append((build_layout([groups[g] for g in gids]), sub, es))
    totals = [count_valid(to_batch(sub), lay) for lay, sub, _ in parts]
    g_tok = sum(t["num_tokens"] for t in totals)
    g_seq = sum(t["num_responses"] for t in totals)
    assert g_tok == m_full["num_tokens"] and g_seq == m_full["num_responses"]

    total, grad, metrics = 0.0, torch.zeros_like(d["lp"]), None
    for lay, sub, es in parts:
        lp = sub["lp"].clone().requires_grad_(True)
        loss, m = policy_loss(lp, to_batch(sub), lay, cfg, global_num_tokens=g_tok, global_num_responses=g_seq)
        loss.backward()
        total = total + loss.detach()
        grad[es] = lp.grad
        metrics = accumulate_metrics(metrics, m)
    torch.testing.assert_close(total, loss_full.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, lp_full.grad, rtol=1e-12, atol=1e-15)
    for k in m_full:
        torch.testing.assert_close(metrics[k], m_full[k], rtol=1e-12, atol=1e-15, msg=k)
    # a rank that normalised by its own count instead would be wrong
    lay, sub, _ = parts[0]
    local, _ = policy_loss(sub["lp"], to_batch(sub), lay, cfg)
    assert local.item() != pytest.approx(policy_loss(sub["lp"], to_batch(sub), lay, cfg,
                                                     global_num_tokens=g_tok, global_num_responses=g_seq)[0].item())


def _reduce_worker(rank, path, results):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    m = {"num_tokens": torch.tensor(3.0 + rank, dtype=F64), "ratio_min": torch.tensor(0.5 + rank, dtype=F64),
         "ratio_max": torch.tensor(2.0 - rank, dtype=F64)}
    reduce_metrics(m)
    results[rank] = {k: v.item() for k, v in m.items()}
    dist.destroy_process_group()


def test_reduce_metrics_uses_sum_min_and_max(tmp_path):
    import torch.multiprocessing as mp
    with mp.Manager() as mgr:
        results = mgr.dict()
        mp.spawn(_reduce_worker, args=(str(tmp_path / "store"), results), nprocs=2)
        for r in range(2):
            assert results[r] == {"num_tokens": 7.0, "ratio_min": 0.5, "ratio_max": 2.0}


def test_entropy_metrics():
    groups = make_groups(7, SHAPES)
    layout = build_layout(groups)
    d = make_rollout(groups, seed=8, multi_turn=False, drop_response=False)
    logits = torch.randn(layout.num_edges, 11, dtype=F64)
    ent = entropy_from_logits(logits)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    _, m = policy_loss(d["lp"], PolicyBatch(advantages=d["adv"]), layout, PolicyLossConfig(entropy="exact"),
                       token_entropy=ent)
    assert m["entropy_sum"].item() == pytest.approx(ent.sum().item(), rel=1e-12)
    # sampled estimate on-policy: -mean(lp)
    _, m = policy_loss(d["lp"], PolicyBatch(advantages=d["adv"]), layout, PolicyLossConfig(entropy="sampled"))
    assert summarize_metrics(m)["entropy_mean"] == pytest.approx(-d["lp"].mean().item(), rel=1e-12)
    with pytest.raises(ValueError, match="token_entropy"):
        policy_loss(d["lp"], PolicyBatch(advantages=d["adv"]), layout, PolicyLossConfig(entropy="exact"))


def test_k3_clamps():
    lp = torch.tensor([0.0, 0.0, -30.0, 0.0], dtype=F64)
    ref = torch.tensor([0.0, 1.0, 0.0, -30.0], dtype=F64)
    kl = k3_kl(lp, ref)
    assert kl[0] == 0
    assert kl[1].item() == pytest.approx(math.e - 2)
    assert kl[2].item() == 10.0  # exp(20) - 21 clamped to 10
    assert kl[3].item() == 10.0  # exp(-20) + 19 clamped to 10
    assert k3_kl(lp, ref, 20.0, None)[3].item() == pytest.approx(math.exp(-20) + 19, rel=1e-12)  # input clamp only
    assert k3_kl(lp, ref, None, None)[3].item() == pytest.approx(math.exp(-30) + 29, rel=1e-12)


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def test_group_advantages_mean_std_and_leave_one_out():
    layout = build_layout(make_groups(9, [(2, [1, 1, 1, 1]), (3, [1, 1, 1]), (1, [1, 1])]))
    r = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 2.0, 3.0, -1.0], dtype=F64)
    groups = [r[0:4], r[4:7], r[7:9]]
    adv = group_advantages(r, layout, baseline="mean", normalize_std=True, eps=1e-6)
    want = torch.cat([(x - x.mean()) / (x.std() + 1e-6) if x.std() > 0 else x - x.mean() for x in groups])
    torch.testing.assert_close(adv, want)
    assert (adv[4:7] == 0).all()  # zero std group: no signal, never divided by eps
    adv_pop = group_advantages(r, layout, unbiased_std=False, eps=0.0)
    torch.testing.assert_close(adv_pop[0:4], (groups[0] - groups[0].mean()) / groups[0].std(unbiased=False))
    torch.testing.assert_close(group_advantages(r, layout, normalize_std=False),
                               torch.cat([x - x.mean() for x in groups]))

    loo = group_advantages(r, layout, baseline="leave_one_out", normalize_std=False)
    loo_std = group_advantages(r, layout, baseline="leave_one_out", normalize_std=True, eps=0.0)
    for gi, x in enumerate(groups):
        base = [0, 4, 7][gi]
        for i in range(len(x)):
            others = torch.cat([x[:i], x[i + 1:]])
            assert loo[base + i].item() == pytest.approx((x[i] - others.mean()).item(), abs=1e-12)
            s = others.std() if len(others) > 1 else torch.tensor(0.0)
            expect = (x[i] - others.mean()) / s if s > 0 else x[i] - others.mean()
            assert loo_std[base + i].item() == pytest.approx(expect.item(), abs=1e-12)
    # rewards [1, 0, 0.5, 0]: the others of response 0 have nonzero spread, of a 2-group none
    assert loo_std[7].item() == pytest.approx(4.0)  # unscaled: 3 - (-1)


def test_group_advantages_from_group_ids_equal_those_from_the_layout():
    layout = build_layout(make_groups(12, [(2, [1, 1, 1, 1]), (3, [1, 1, 1]), (1, [1, 1])]))
    r = torch.randn(9, dtype=F64)
    ids = layout.response_group.clone()
    perm = torch.randperm(9)  # group ids need not be contiguous
    for baseline in ("mean", "leave_one_out"):
        want = group_advantages(r, layout, baseline=baseline)
        torch.testing.assert_close(group_advantages(r[perm], ids[perm], baseline=baseline), want[perm])
    r[5] = float("inf")
    with pytest.raises(ValueError, match=r"rewards has a non-finite value inf at response 5 \(group 1\)"):
        group_advantages(r, ids)
    with pytest.raises(ValueError, match="group ids"):
        group_advantages(r, ids.double())


def test_group_advantages_valid_mask_and_small_groups():
    layout = build_layout(make_groups(10, [(2, [1, 1, 1]), (2, [1])]))
    r = torch.tensor([1.0, 0.0, 7.0, 5.0], dtype=F64)
    valid = torch.tensor([True, True, False, True])
    adv = group_advantages(r, layout, valid=valid, normalize_std=False)
    # response 2 excluded from its group's mean and given 0; the single-response group gets 0
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=F64))
    # a NaN reward on an invalid response is ignored, on a valid one it is an error
    r_nan = r.clone()
    r_nan[2] = float("nan")
    torch.testing.assert_close(group_advantages(r_nan, layout, valid=valid, normalize_std=False), adv)
    with pytest.raises(ValueError, match=r"rewards .*response 2 \(response 2 of group 0\)"):
        group_advantages(r_nan, layout)
    with pytest.raises(ValueError, match=r"rewards: expected shape \[4\]"):
        group_advantages(r[:3], layout)
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(r, layout, baseline="median")


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.fixture
def small():
    groups = [([1, 2, 3], [[4, 5], [6]]), ([7], [[8, 9, 10]])]
    from megatron_dualkv import Group
    layout = build_layout([groups[0], Group.of(*groups[1], name="q42")])
    d = make_rollout(groups, seed=11, multi_turn=False, drop_response=False)
    return layout, d


def test_non_finite_inputs_name_the_input_and_the_response(small):
    layout, d = small
    adv = d["adv"].clone()
    adv[2] = float("nan")
    with pytest.raises(ValueError, match=r"advantages .*nan.*response 2 \(response 0 of group 1 'q42'\)"):
        policy_loss(d["lp"], PolicyBatch(advantages=adv), layout)
    for name in ("lp", "old", "ref", "gen"):
        x = d[name].clone()
        x[4] = float("nan")  # edge 4 = token 1 of response 2
        dd = dict(d, **{name: x})
        cfg = PolicyLossConfig(kl_beta=0.1, importance_correction=True)
        label = {"lp": "logprobs", "old": "old_logprobs", "ref": "ref_logprobs", "gen": "generation_logprobs"}[name]
        with pytest.raises(ValueError, match=rf"^{label} has a non-finite value nan at response 2 \(response 0 of group 1 'q42'\), token 1 \(edge 4\)"):
            policy_loss(dd["lp"], to_batch(dd), layout, cfg)
        # the same value on a masked edge is ignored entirely
        mask = torch.ones(layout.num_edges, dtype=torch.bool)
        mask[4] = False
        clean = dict(d, loss_mask=mask)
        masked = dict(dd, loss_mask=mask)
        a, _ = policy_loss(masked["lp"], to_batch(masked), layout, cfg)
        b, _ = policy_loss(clean["lp"], to_batch(clean), layout, cfg)
        assert torch.isfinite(a) and a.item() == b.item()


def test_shape_mismatches_name_the_expected_sizes(small):
    layout, d = small
    E, M = layout.num_edges, layout.num_responses
    with pytest.raises(ValueError, match=rf"logprobs: expected shape \[{E}\] \(one per loss edge\), got \[{E + 1}\]"):
        policy_loss(torch.zeros(E + 1, dtype=F64), to_batch(d), layout)
    with pytest.raises(ValueError, match=rf"advantages: expected shape \[{M}\] \(one per response\), got \[{E}\]"):
        policy_loss(d["lp"], PolicyBatch(advantages=torch.zeros(E)), layout)
    for field in ("old_logprobs", "ref_logprobs", "generation_logprobs", "loss_mask"):
        kw = {"advantages": d["adv"], field: torch.zeros(E, 1)}
        with pytest.raises(ValueError, match=rf"{field}: expected shape \[{E}\]"):
            policy_loss(d["lp"], PolicyBatch(**kw), layout)
    with pytest.raises(ValueError, match=rf"response_mask: expected shape \[{M}\]"):
        policy_loss(d["lp"], PolicyBatch(advantages=d["adv"], response_mask=torch.ones(M + 2)), layout)
    with pytest.raises(ValueError, match="floating point"):
        policy_loss(torch.zeros(E, dtype=torch.long), to_batch(d), layout)


def test_missing_inputs_and_bad_normalisers(small):
    layout, d = small
    with pytest.raises(ValueError, match="ref_logprobs is required by kl_beta"):
        policy_loss(d["lp"], PolicyBatch(advantages=d["adv"]), layout, PolicyLossConfig(kl_beta=0.1))
    with pytest.raises(ValueError, match="generation_logprobs is required by importance_correction"):
        policy_loss(d["lp"], PolicyBatch(advantages=d["adv"]), layout, PolicyLossConfig(importance_correction=True))
    with pytest.raises(ValueError, match="generation_logprobs is required by on_policy_kl_approximation"):
        policy_loss(d["lp"], to_batch(d, gen=False), layout, PolicyLossConfig(kl_beta=0.1, on_policy_kl_approximation=True))
    with pytest.raises(ValueError, match="global_num_tokens must be a positive"):
        policy_loss(d["lp"], to_batch(d), layout, global_num_tokens=0)
    with pytest.raises(ValueError, match=r"global_num_tokens=3.0 is smaller than this micro-batch's own count 6.0"):
        policy_loss(d["lp"], to_batch(d), layout, global_num_tokens=3)
    with pytest.raises(ValueError, match="global_num_responses must be a positive"):
        policy_loss(d["lp"], to_batch(d), layout, PolicyLossConfig(aggregation="sequence"),
                    global_num_responses=float("nan"))
    with pytest.raises(ValueError, match="loss_mask must hold finite non-negative"):
        policy_loss(d["lp"], PolicyBatch(advantages=d["adv"], loss_mask=-torch.ones(layout.num_edges)), layout)


def test_fully_masked_micro_batch(small):
    layout, d = small
    batch = PolicyBatch(advantages=d["adv"], loss_mask=torch.zeros(layout.num_edges, dtype=torch.bool))
    with pytest.raises(ValueError, match="nothing to average over"):
        policy_loss(d["lp"], batch, layout)
    # with a global count (other ranks have tokens) it contributes exactly zero, gradient included
    lp = d["lp"].clone().requires_grad_(True)
    loss, m = policy_loss(lp, batch, layout, global_num_tokens=10)
    loss.backward()
    assert loss.item() == 0 and (lp.grad == 0).all() and m["num_tokens"] == 0
    assert m["ratio_min"] == float("inf") and m["ratio_max"] == float("-inf")


def test_check_finite_off_skips_the_checks(small):
    layout, d = small
    adv = d["adv"].clone()
    adv[0] = float("nan")
    loss, _ = policy_loss(d["lp"], PolicyBatch(advantages=adv), layout, PolicyLossConfig(check_finite=False))
    assert loss.isnan()


@pytest.mark.parametrize("kwargs,match", [
    (dict(clip_low=1.0), "clip_low must lie in"),
    (dict(clip_low=-0.1), "clip_low must lie in"),
    (dict(clip_high=-0.1), "clip_high must be >= 0"),
    (dict(dual_clip=1.0), "dual_clip must be > 1"),
    (dict(kl_input_clamp=0.0), "kl_input_clamp must be > 0"),
    (dict(aggregation="mean"), "aggregation must be one of"),
    (dict(entropy="full"), "entropy must be one of"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


# --------------------------------------------------------------------------------------------
# End to end: the loss through the DualKV Megatron model == through stock Megatron, replicated
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_grpo_loss_and_every_parameter_gradient_through_megatron_match_replicated(size):
    """DualKV model -> edge logprobs -> policy_loss, against the stock GPTModel on NeMo-RL style
    [B, S] rows -> log_softmax(logits[:, :-1]) gathered at input_ids[:, 1:] -> the replicated
    reference loss above. Same weights; float64; DAPO clips, dual clip, k3 KL, masks."""
    from megatron_cpu import cuda_runtime_as_cpu, gloo_world_of_one, model_parallel
    from megatron_dualkv.megatron import build_dualkv_model, build_replicated_model, copy_weights, qwen3_config

    vocab = 128
    groups = make_groups(13, [(5, [3, 1, 4]), (2, [6, 2]), (4, [2])])
    groups = [(p, [[t % vocab for t in r] for r in rs]) for p, rs in groups]
    with gloo_world_of_one(), cuda_runtime_as_cpu(), model_parallel(tp=1) as pgs:
        # MoE: no aux loss here (its equality is tests/test_megatron_model.py's); this isolates
        # the policy loss's gradient through routing and experts
        extra = dict(moe_aux_loss_coeff=0.0) if "moe" in size else {}
        cfg = qwen3_config(size, use_cpu_initialization=True, params_dtype=F64, vocab_size=vocab, **extra)
        torch.manual_seed(7)
        model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False).double()
        base = build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False).double()
        copy_weights(model, base)

        layout = build_layout(groups, vocab_size=vocab, pad_to_multiple=8)
        lp = model(layout=layout).logprobs
        d = make_rollout(groups, seed=14)
        g = torch.Generator().manual_seed(19)
        for k in ("old", "ref", "gen"):  # ratios around 1, wide enough for every clip to bind
            d[k] = lp.detach() + 0.8 * torch.randn(layout.num_edges, generator=g, dtype=F64)
        loss_cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=2.0, kl_beta=0.1,
                                    importance_correction=True)
        loss, m = policy_loss(lp, to_batch(d), layout, loss_cfg)
        assert m["clip_high_count"] > 0 and m["clip_low_count"] > 0 and m["dual_clip_count"] > 0
        loss.backward()

        # replicated: right-padded [prompt | response] rows through the stock model
        rows = [p + r for p, rs in groups for r in rs]
        B, S = len(rows), max(map(len, rows))
        ids = torch.zeros(B, S, dtype=torch.long)
        pad = torch.ones(B, S, dtype=torch.bool)
        for b, row in enumerate(rows):
            ids[b, :len(row)] = torch.tensor(row)
            pad[b, :len(row)] = False
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
        logits = base(ids, torch.arange(S).expand(B, S), causal, padding_mask=pad)  # [B, S, V]
        curr = torch.zeros(B, S, dtype=F64)
        curr[:, 1:] = torch.log_softmax(logits[:, :-1].double(), -1).gather(2, ids[:, 1:, None]).squeeze(2)
        rep = to_replicated(groups, d, lp.detach())
        rep["curr"] = curr
        ref_loss, _ = replicated_loss(
            rep, dict(eps_low=0.2, eps_high=0.28, c=2.0, beta=0.1, **{"is": True}),
            (rep["token_mask"][:, 1:] * rep["sample_mask"][:, None]).sum(), rep["sample_mask"].sum())
        ref_loss.backward()

    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=0)
    # Megatron's top-k router takes its softmax in float32 even in a float64 model: MoE gradients
    # agree to float32 rounding of the routing probabilities, dense ones to float64 rounding
    tol = dict(rtol=1e-6, atol=1e-9) if "moe" in size else dict(rtol=1e-8, atol=1e-12)
    got, want = dict(model.named_parameters()), dict(base.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert p.grad is not None and got[name].grad is not None, name
        torch.testing.assert_close(got[name].grad, p.grad, **tol, msg=lambda s: f"{name}: {s}")
    assert any(p.grad.abs().max() > 0 for p in got.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_leave_one_out_with_equal_others_is_not_blown_up(dtype):
    """Others all equal: their std is exactly 0, so the advantage stays r - b (regression: the
    cancelling sum of squares once left ~1e-17 and the std scaling returned -1e6)."""
    layout = build_layout([([0], [[0]] * 5)])
    adv = group_advantages(torch.tensor([1.0, 0, 1, 1, 1], dtype=dtype), layout, baseline="leave_one_out")
    # response 1: others {1,1,1,1} -> b = 1, std 0 -> -1 unscaled; others of response 0: {0,1,1,1}
    others = torch.tensor([0.0, 1, 1, 1], dtype=torch.float64)
    expect0 = (1 - others.mean()) / (others.std() + 1e-6)
    torch.testing.assert_close(adv[1], torch.tensor(-1.0, dtype=dtype))
    torch.testing.assert_close(adv[0].double(), expect0, rtol=1e-6, atol=0)
