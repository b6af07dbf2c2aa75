"""Rollout groups -> DualKV micro-batches, balanced over data-parallel ranks, and back.

Planning (`plan_packing`, pure Python, identical on every rank for the same records and seed):

1. Shuffle the groups (seeded) and split any group that does not fit one micro-batch into
   sub-groups of consecutive responses, each carrying the full prompt. A prompt plus one response
   that alone exceeds a budget is an error.
2. Pack the pieces into K = dp_size * m micro-batches: longest-processing-time first, each piece
   into the least-loaded micro-batch where it fits both budgets. K starts at a lower bound (the
   budgets; one micro-batch per piece above half the token budget) rounded up to dp_size and is
   the smallest multiple of dp_size that fits (grown exponentially, then bisected). When there
   are fewer pieces than K (few groups, many ranks), the largest groups are split further so that
   no micro-batch is empty.
3. Deal the micro-batches to ranks in rounds of dp_size, heaviest first, the heaviest of a round to
   the rank with the least work so far; every rank gets m micro-batches.

Budgets: `max_tokens` bounds the padded length of a micro-batch (packed tokens P + sum(R) of its
groups, rounded up to `pad_to_multiple`); `max_attention_pairs` bounds the (query, key) pairs of the
DualKV mask over the real tokens (`flops.group_pairs`; padding adds at most m(m-1)/2 for multiple m).

Balance: work = work_per_token * tokens + work_per_pair * attention pairs (tokens only by default;
set the ratio from your model's FLOPs, see docs/DATA.md). Bound: the spread of work across ranks
(max - min of the per-rank sums) is at most the spread across micro-batches (max - min of the
micro-batch work), hence at most the heaviest micro-batch. Proof: in each round ranks sorted by
ascending load get micro-batches of descending work, so a spread D before a round becomes at most
max(D, heaviest - lightest micro-batch of the round).

Materialising (`build_micro_batches`): per micro-batch one `MicroBatch` holding its Groups, the
PackedLayout (`build_layout`) and the per-response / per-edge training signals in layout order.
`scatter_to_records` puts per-edge results (e.g. new logprobs) back as [record][response] tensors.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .data.advantages import AdvantageEstimator, compute_advantages
from .data.schema import RolloutGroup, check_unique_ids
from .flops import attended_pairs, attention_flops, group_pairs
from .layout import Group, PackedLayout, build_layout

LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "generation_logprobs")


def _causal(n: int) -> int:
    return n * (n + 1) // 2


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class PackingConfig:
    max_tokens: int  # padded length of one micro-batch
    max_attention_pairs: Optional[int] = None  # DualKV-mask (query, key) pairs of one micro-batch
    dp_size: int = 1
    pad_to_multiple: int = 1  # TP sequence parallel: tp; CP: 2 * cp (lcm of both when combined)
    pad_token_id: int = 0
    vocab_size: Optional[int] = None
    seed: int = 0
    shuffle: bool = True
    work_per_token: float = 1.0
    work_per_pair: float = 0.0
    # Turns rewards into advantages for records that have no advantages (None: never).
    advantage: Optional[AdvantageEstimator] = field(default_factory=AdvantageEstimator)

    def __post_init__(self):
        if self.pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {self.pad_to_multiple}")
        if self.max_tokens < self.pad_to_multiple or self.max_tokens % self.pad_to_multiple:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be a positive multiple of "
                             f"pad_to_multiple ({self.pad_to_multiple})")
        if self.max_attention_pairs is not None and self.max_attention_pairs < 1:
            raise ValueError(f"max_attention_pairs must be >= 1, got {self.max_attention_pairs}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.work_per_token < 0 or self.work_per_pair < 0 or self.work_per_token + self.work_per_pair <= 0:
            raise ValueError("work_per_token and work_per_pair must be >= 0 and not both 0")

    def fits(self, tokens: int, pairs: int) -> bool:
        return (_round_up(tokens, self.pad_to_multiple) <= self.max_tokens
                and (self.max_attention_pairs is None or pairs <= self.max_attention_pairs))

    def work(self, tokens: int, pairs: int) -> float:
        return self.work_per_token * tokens + self.work_per_pair * pairs


def flop_work_weights(num_layers: int, num_q_heads: int, head_dim: int, active_params: float) -> dict[str, float]:
    """work_per_token / work_per_pair as forward+backward FLOPs, for PackingConfig(**weights).

    A token costs 6 FLOPs per active (non-embedding) parameter it passes through (2 forward, 4
    backward); an attended (query, key) pair costs `flops.attention_flops(1, ...)` fwd+bwd per layer.
    """
    return {"work_per_token": 6.0 * active_params,
            "work_per_pair": num_layers * attention_flops(1, num_q_heads, head_dim, backward=True)}


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A (sub-)group: the prompt of record `record` with its responses `responses` (consecutive)."""

    record: int
    responses: tuple[int, ...]
    tokens: int  # P + sum(R)
    pairs: int  # DualKV attention pairs
    order: int  # position after the seeded shuffle; breaks ties and orders groups in a micro-batch


def _piece(record: int, responses: Sequence[int], prompt_len: int, lengths: Sequence[int], order: int) -> Piece:
    rs = [lengths[i] for i in responses]
    return Piece(record, tuple(responses), prompt_len + sum(rs), group_pairs(prompt_len, rs)[0], order)


def _split_to_fit(rec: RolloutGroup, index: int, order: int, cfg: PackingConfig) -> list[Piece]:
    """Consecutive responses, greedily, each piece carrying the prompt and fitting both budgets."""
    p, lengths = len(rec.prompt), rec.response_lengths
    pieces, cur, tokens, pairs = [], [], p, _causal(p)
    for i, r in enumerate(lengths):
        add = r * p + _causal(r)
        if not cfg.fits(p + r, _causal(p) + add):
            raise ValueError(
                f"group {rec.group_id!r}: response {i} ({r} tokens) with its prompt ({p} tokens) does not fit one "
                f"micro-batch ({p + r} tokens, {_causal(p) + add} attention pairs; budgets: max_tokens "
                f"{cfg.max_tokens} with padding to {cfg.pad_to_multiple}, max_attention_pairs {cfg.max_attention_pairs})"
            )
        if cur and not cfg.fits(tokens + r, pairs + add):
            pieces.append(_piece(index, cur, p, lengths, order))
            cur, tokens, pairs = [], p, _causal(p)
        cur.append(i)
        tokens, pairs = tokens + r, pairs + add
    pieces.append(_piece(index, cur, p, lengths, order))
    return pieces


def _split_until(pieces: list[Piece], k: int, records: Sequence[RolloutGroup], cfg: PackingConfig) -> list[Piece]:
    """Halve the heaviest multi-response pieces until there are at least k (no empty micro-batch)."""
    pieces = list(pieces)
    while len(pieces) < k:
        candidates = [i for i, pc in enumerate(pieces) if len(pc.responses) > 1]
        if not candidates:
            total = sum(len(pc.responses) for pc in pieces)
            raise ValueError(
                f"cannot fill {k} micro-batches ({cfg.dp_size} data-parallel ranks x {k // cfg.dp_size}): "
                f"only {total} responses in {len(records)} groups; every micro-batch needs at least one"
            )
        i = max(candidates, key=lambda j: (cfg.work(pieces[j].tokens, pieces[j].pairs), -pieces[j].order))
        pc = pieces[i]
        rec = records[pc.record]
        half = (len(pc.responses) + 1) // 2
        p, lengths = len(rec.prompt), rec.response_lengths
        pieces[i:i + 1] = [_piece(pc.record, pc.responses[:half], p, lengths, pc.order),
                           _piece(pc.record, pc.responses[half:], p, lengths, pc.order)]
    return pieces


def _pack(pieces: Sequence[Piece], k: int, cfg: PackingConfig) -> Optional[list[list[Piece]]]:
    """LPT into k micro-batches under both budgets; None when some piece fits nowhere."""
    tokens, pairs, content = [0] * k, [0] * k, [[] for _ in range(k)]
    heap = [(0.0, b) for b in range(k)]
    for pc in sorted(pieces, key=lambda pc: (-cfg.work(pc.tokens, pc.pairs), pc.order, pc.responses)):
        skipped = []
        while heap:
            w, b = heapq.heappop(heap)
            if cfg.fits(tokens[b] + pc.tokens, pairs[b] + pc.pairs):
                tokens[b] += pc.tokens
                pairs[b] += pc.pairs
                content[b].append(pc)
                heapq.heappush(heap, (w + cfg.work(pc.tokens, pc.pairs), b))
                break
            skipped.append((w, b))
        else:
            return None
        for item in skipped:
            heapq.heappush(heap, item)
    return content


@dataclass(frozen=True)
class PackingPlan:
    """Which pieces go into which micro-batch of which data-parallel rank."""

    config: PackingConfig
    record_num_responses: tuple[int, ...]
    ranks: tuple[tuple[tuple[Piece, ...], ...], ...]  # [dp_rank][micro-batch] -> pieces

    @property
    def num_micro_batches_per_rank(self) -> int:
        return len(self.ranks[0])

    def micro_batch_work(self) -> list[list[float]]:
        cfg = self.config
        return [[sum(cfg.work(pc.tokens, pc.pairs) for pc in mb) for mb in rank] for rank in self.ranks]

    def rank_work(self) -> list[float]:
        return [sum(ws) for ws in self.micro_batch_work()]

    def summary(self) -> dict:
        """Totals over the whole step (all ranks), from the plan alone."""
        mbs = [mb for rank in self.ranks for mb in rank]
        pieces = [pc for mb in mbs for pc in mb]
        work = self.rank_work()
        return {
            "dp_size": len(self.ranks),
            "micro_batches_per_rank": self.num_micro_batches_per_rank,
            "groups": len(self.record_num_responses),
            "pieces": len(pieces),
            "split_groups": sum(1 for n in Counter(pc.record for pc in pieces).values() if n > 1),
            "tokens": sum(pc.tokens for pc in pieces),
            "attention_pairs": sum(pc.pairs for pc in pieces),
            "rank_work": work,
            "rank_work_spread": max(work) - min(work),
            "rank_imbalance": max(work) / (sum(work) / len(work)),
        }


def _check_all_or_none(records: Sequence[RolloutGroup], values: Sequence, what: str) -> bool:
    have = [v is not None for v in values]
    if any(have) and not all(have):
        a = records[have.index(True)].group_id
        b = records[have.index(False)].group_id
        raise ValueError(f"{what} is given for group {a!r} but not for group {b!r}: give it for every group or none")
    return all(have)


def record_advantages(records: Sequence[RolloutGroup], cfg: PackingConfig) -> list[Optional[tuple[float, ...]]]:
    """Each record's advantages, else those of its rewards (over the whole group, before any split)."""
    need = [r for r in records if r.advantages is None and r.rewards is not None]
    computed = iter(compute_advantages(need, cfg.advantage) if need and cfg.advantage is not None else [])
    out = []
    for r in records:
        if r.advantages is not None:
            out.append(r.advantages)
        elif r.rewards is not None and cfg.advantage is not None:
            out.append(next(computed))
        else:
            out.append(None)
    return out


def plan_packing(records: Sequence[RolloutGroup], config: PackingConfig) -> PackingPlan:
    """Deterministic for (records, config); see the module docstring for the algorithm."""
    cfg = config
    records = list(records)
    if not records:
        raise ValueError("no rollout groups to pack")
    check_unique_ids(records)
    for i, rec in enumerate(records):
        if not isinstance(rec, RolloutGroup):
            raise TypeError(f"record {i}: expected a RolloutGroup, got {type(rec).__name__}")
        if cfg.vocab_size is not None:
            rec.check_vocab(cfg.vocab_size)
    # every micro-batch must hold the same signals (a loss cannot mix present and absent ones)
    have_adv = [r.advantages is not None or (r.rewards is not None and cfg.advantage is not None) for r in records]
    _check_all_or_none(records, [True if h else None for h in have_adv], "an advantage (or a reward)")
    for name in ("rewards",) + LOGPROB_FIELDS:
        _check_all_or_none(records, [getattr(r, name) for r in records], name)

    order = list(range(len(records)))
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(order)
    pieces = [pc for pos, i in enumerate(order) for pc in _split_to_fit(records[i], i, pos, cfg)]

    dp = cfg.dp_size
    # lower bounds on the number of micro-batches: the budgets, and pieces over half the token budget
    need = max(1, -(-sum(pc.tokens for pc in pieces) // cfg.max_tokens),
               sum(1 for pc in pieces if 2 * pc.tokens > cfg.max_tokens))
    if cfg.max_attention_pairs is not None:
        need = max(need, -(-sum(pc.pairs for pc in pieces) // cfg.max_attention_pairs))

    def attempt(k: int):
        ps = _split_until(pieces, k, records, cfg)
        return _pack(ps, k, cfg)

    # Grow the number of rounds exponentially to a feasible one, then bisect back down. With at
    # least as many micro-batches as pieces every piece gets its own: that always fits.
    lo_rounds = -(-need // dp)
    max_rounds = max(lo_rounds, -(-len(pieces) // dp))
    rounds, bins = lo_rounds, attempt(lo_rounds * dp)
    last_fail, step = lo_rounds - 1, 1
    while bins is None:
        if rounds >= max_rounds:  # unreachable: one piece per micro-batch always fits
            raise AssertionError(f"packing failed with {rounds * dp} micro-batches for {len(pieces)} pieces")
        last_fail, rounds = rounds, min(lo_rounds + step, max_rounds)
        step *= 2
        bins = attempt(rounds * dp)
    lo, hi = last_fail, rounds  # lo fails (or is below the bound), hi works
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = attempt(mid * dp)
        if got is None:
            lo = mid
        else:
            hi, bins = mid, got
    # within a micro-batch, groups follow the shuffled order
    bins = [sorted(b, key=lambda pc: (pc.order, pc.responses)) for b in bins]

    work = [sum(cfg.work(pc.tokens, pc.pairs) for pc in b) for b in bins]
    by_work = sorted(range(len(bins)), key=lambda b: (-work[b], b))
    ranks: list[list[list[Piece]]] = [[] for _ in range(dp)]
    load = [0.0] * dp
    for start in range(0, len(by_work), dp):
        for b, r in zip(by_work[start:start + dp], sorted(range(dp), key=lambda r: (load[r], r))):
            ranks[r].append(bins[b])
            load[r] += work[b]
    if cfg.shuffle:
        rng = random.Random(cfg.seed + 1)
        for rank in ranks:
            rng.shuffle(rank)
    return PackingPlan(
        config=cfg,
        record_num_responses=tuple(r.num_responses for r in records),
        ranks=tuple(tuple(tuple(mb) for mb in rank) for rank in ranks),
    )


# --------------------------------------------------------------------------------------------
# Micro-batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatchStats:
    num_groups: int  # (sub-)groups packed
    num_responses: int
    tokens: int  # real packed tokens, P + sum(R) per (sub-)group
    padded_tokens: int  # the layout's length
    padding: int
    replicated_tokens: int  # what the replicated batch holds: sum over responses of P + R
    response_tokens: int  # loss edges
    loss_tokens: int  # edges with loss mask 1
    attention_pairs: int  # DualKV mask pairs, padding segment included
    replicated_attention_pairs: int
    work: float

    @property
    def dedup_ratio(self) -> float:
        return self.replicated_tokens / self.tokens

    @property
    def attention_reduction(self) -> float:
        return self.replicated_attention_pairs / self.attention_pairs


@dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch and everything the model and the loss read, in layout order.

    Responses are in the layout's order (group-major); `response_source[m]` is the (record,
    response) it came from. Per-edge tensors follow the layout's edge order (response-major).
    """

    layout: PackedLayout
    groups: tuple[Group, ...]
    response_source: tuple[tuple[int, int], ...]
    advantages: Optional[Tensor]  # float32 [M]
    rewards: Optional[Tensor]  # float32 [M]
    old_logprobs: Optional[Tensor]  # float32 [E]
    ref_logprobs: Optional[Tensor]  # float32 [E]
    generation_logprobs: Optional[Tensor]  # float32 [E]
    loss_mask: Tensor  # float32 [E], 1 where the token counts in the loss
    stats: MicroBatchStats
    dp_rank: int
    index: int  # position in its rank's list

    @property
    def edge_advantages(self) -> Optional[Tensor]:
        """float32 [E]: the advantage of each edge's response."""
        return None if self.advantages is None else self.advantages[self.layout.edge_response]

    def to(self, device: torch.device | str) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), (Tensor, PackedLayout))}
        return dataclasses.replace(self, **moved)

    def policy_batch(self, old_logprobs: Optional[Tensor] = None):
        """The loss's input (`megatron_dualkv.loss.PolicyBatch`); `old_logprobs` [E] overrides the
        stored ones (e.g. recomputed by the current policy before the update)."""
        from .loss import PolicyBatch

        if self.advantages is None:
            raise ValueError(f"micro-batch {self.index} of rank {self.dp_rank}: no advantages (the records have "
                             f"neither advantages nor rewards)")
        return PolicyBatch(
            advantages=self.advantages,
            old_logprobs=self.old_logprobs if old_logprobs is None else old_logprobs,
            ref_logprobs=self.ref_logprobs, loss_mask=self.loss_mask,
            generation_logprobs=self.generation_logprobs,
        )

    def split_edges(self, values: Tensor) -> list[tuple[tuple[int, int], Tensor]]:
        """Per-edge values [E, ...] -> ((record, response), values of that response) pairs."""
        if values.shape[0] != self.layout.num_edges:
            raise ValueError(f"micro-batch {self.index} of rank {self.dp_rank}: expected {self.layout.num_edges} "
                             f"per-edge values, got {values.shape[0]}")
        offs = self.layout.response_edge_offsets
        return [(src, values[offs[m]:offs[m + 1]]) for m, src in enumerate(self.response_source)]


def _piece_name(rec: RolloutGroup, pc: Piece) -> str:
    if len(pc.responses) == rec.num_responses:
        return rec.group_id
    return f"{rec.group_id}[responses {pc.responses[0]}..{pc.responses[-1]}]"


def _materialise(records: Sequence[RolloutGroup], advantages: dict[int, Optional[tuple[float, ...]]],
                 pieces: Sequence[Piece], cfg: PackingConfig, dp_rank: int, index: int,
                 device: torch.device | str) -> MicroBatch:
    groups, source = [], []
    adv, rew, mask = [], [], []
    logprobs: dict[str, list[float]] = {name: [] for name in LOGPROB_FIELDS}
    for pc in pieces:
        rec = records[pc.record]
        groups.append(Group(prompt=rec.prompt, responses=tuple(rec.responses[i] for i in pc.responses),
                            name=_piece_name(rec, pc)))
        a = advantages[pc.record]
        for i in pc.responses:
            source.append((pc.record, i))
            adv.append(None if a is None else a[i])
            rew.append(None if rec.rewards is None else rec.rewards[i])
            for name, into in logprobs.items():
                values = getattr(rec, name)
                into.extend(() if values is None else values[i])
            mask.extend([1] * len(rec.responses[i]) if rec.loss_mask is None else rec.loss_mask[i])
    layout = build_layout(groups, vocab_size=cfg.vocab_size, max_tokens=cfg.max_tokens,
                          pad_to_multiple=cfg.pad_to_multiple, pad_token_id=cfg.pad_token_id, device=device)
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)
    per_edge = lambda xs: f32(xs) if len(xs) == layout.num_edges else None  # all-or-none checked in the plan
    loss_mask = f32(mask)

    repl_pairs = 0
    for g in groups:
        repl_pairs += group_pairs(len(g.prompt), [len(r) for r in g.responses])[1]
    tokens = layout.num_real_tokens
    pairs = sum(pc.pairs for pc in pieces)
    stats = MicroBatchStats(
        num_groups=len(groups), num_responses=layout.num_responses, tokens=tokens,
        padded_tokens=layout.num_tokens, padding=layout.num_tokens - tokens,
        replicated_tokens=layout.replicated_num_tokens(), response_tokens=layout.num_edges,
        loss_tokens=int(sum(mask)), attention_pairs=attended_pairs(layout),
        replicated_attention_pairs=repl_pairs, work=cfg.work(tokens, pairs),
    )
    return MicroBatch(
        layout=layout, groups=tuple(groups), response_source=tuple(source),
        advantages=None if adv[0] is None else f32(adv), rewards=None if rew[0] is None else f32(rew),
        **{name: per_edge(values) for name, values in logprobs.items()}, loss_mask=loss_mask,
        stats=stats, dp_rank=dp_rank, index=index,
    )


def build_micro_batches(records: Sequence[RolloutGroup], plan: PackingPlan, dp_rank: int,
                        device: torch.device | str = "cpu") -> list[MicroBatch]:
    """The micro-batches of one data-parallel rank (each rank builds only its own)."""
    if not 0 <= dp_rank < len(plan.ranks):
        raise ValueError(f"dp_rank {dp_rank} outside [0, {len(plan.ranks)})")
    if tuple(r.num_responses for r in records) != plan.record_num_responses:
        raise ValueError("these records are not the ones the plan was made for")
    used = sorted({pc.record for mb in plan.ranks[dp_rank] for pc in mb})
    advantages = dict(zip(used, record_advantages([records[i] for i in used], plan.config)))
    return [_materialise(records, advantages, mb, plan.config, dp_rank, j, device)
            for j, mb in enumerate(plan.ranks[dp_rank])]


def pack_rollouts(records: Sequence[RolloutGroup], config: PackingConfig,
                  device: torch.device | str = "cpu") -> list[list[MicroBatch]]:
    """Plan and build the micro-batches of every rank: [dp_rank][micro-batch]."""
    records = list(records)
    plan = plan_packing(records, config)
    return [build_micro_batches(records, plan, r, device) for r in range(config.dp_size)]


def step_records(records: Sequence[RolloutGroup], step: int, groups_per_step: int, seed: int = 0,
                 ) -> list[RolloutGroup]:
    """The groups of training step `step`: consecutive slices of a stream that visits every group
    once per epoch, in a seeded order per epoch. A function of (step, seed) alone, so a run resumed
    at step s gets the groups the uninterrupted run would have had."""
    n = len(records)
    if n == 0 or not 1 <= groups_per_step <= n:
        raise ValueError(f"groups_per_step must lie in [1, {n}] (the number of groups), got {groups_per_step}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    out, pos = [], step * groups_per_step
    perms: dict[int, list[int]] = {}
    for k in range(pos, pos + groups_per_step):
        epoch = k // n
        if epoch not in perms:
            perms[epoch] = list(range(n))
            random.Random(f"{seed}/{epoch}").shuffle(perms[epoch])
        out.append(records[perms[epoch][k % n]])
    return out


def global_loss_counts(records: Sequence[RolloutGroup]) -> dict[str, int]:
    """The loss's global normalisers for a step over these records, without an all-reduce: every
    rank holds the records, and packing neither adds nor drops a response token. Equal to the sum
    of `loss.count_valid` over every micro-batch of every rank (no response mask)."""
    tokens = sum(sum(r.response_lengths) if r.loss_mask is None else sum(map(sum, r.loss_mask)) for r in records)
    return {"num_tokens": tokens, "num_responses": sum(r.num_responses for r in records)}


def scatter_to_records(micro_batches: Iterable[MicroBatch], values: Iterable[Tensor],
                       record_num_responses: Sequence[int], require_complete: bool = True,
                       ) -> list[list[Optional[Tensor]]]:
    """Per-edge results of micro-batches -> out[record][response] (a [R_i, ...] tensor each).

    micro_batches and values are matched in order. With require_complete, every response of every
    record must be covered exactly once (pass all ranks' micro-batches); otherwise the responses of
    other ranks stay None.
    """
    out: list[list[Optional[Tensor]]] = [[None] * n for n in record_num_responses]
    for mb, v in zip(micro_batches, values, strict=True):
        for (rec, i), vals in mb.split_edges(v):
            if out[rec][i] is not None:
                raise ValueError(f"record {rec} response {i} appears in more than one micro-batch")
            out[rec][i] = vals
    if require_complete:
        missing = [(r, i) for r, row in enumerate(out) for i, v in enumerate(row) if v is None]
        if missing:
            raise ValueError(f"{len(missing)} responses were not in any micro-batch, first (record, response) "
                             f"{missing[0]}")
    return out
