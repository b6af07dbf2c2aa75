"""A NeMo-RL batch ([B, S] rows, one per response) <-> DualKV groups and micro-batches.

NeMo-RL's data contract (BatchedDataDict): `input_ids` [B, S] right-padded (prompt then response),
`input_lengths` [B], `token_mask` [B, S] (1 only on generated tokens), `sample_mask` [B],
`advantages` [B, S] (or [B]), `prev_logprobs`, `generation_logprobs`,
`reference_policy_logprobs` [B, S] with logprobs[:, t] = log p(token t | tokens < t).

Where the prompt ends. The prompt of a row is every token before its first generated token
(the first column where token_mask != 0); the response runs from there to input_lengths. In a
multi-turn rollout the later user/tool turns lie inside the response: they are response tokens
of the packed micro-batch (their logprobs are computed) with loss mask token_mask = 0. Rows of a
group must have the same first-generated position and identical tokens before it.

A row without any generated token (token_mask 0 up to its length, e.g. a truncated multi-turn
sample) is not packed: it adds nothing to ClippedPGLossFn's loss (the normalisers still come from the
whole batch) and its logprobs come back as 0.

Which rows form a group. With an explicit id column (`group_id_key`, default "prompt_id", when
the batch has it) rows with equal ids form a group, wherever they sit. Otherwise the batch must be
consecutive copies: rows [k*N, (k+1)*N) with N = num_generations_per_prompt (NeMo-RL's
repeat_interleave). Either way the claim is verified against the tokens and the token_mask
boundary, never assumed; a mismatch raises `NemoRLBatchError` naming the rows. Grouping only
decides which rows share one copy of the prompt, so verified groups make the result exact.

Back: per-edge results of the micro-batches (logprobs) are written to [B, S] in NeMo-RL's
convention: column t of row b holds the value for token t; every column outside the response
span [prompt_length, input_length) is 0 (column 0, the prompt, padding). NeMo-RL reads prompt
columns of logprobs nowhere: its losses mask them with token_mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ...data.schema import RolloutGroup
from ...packing import MicroBatch, PackingConfig, build_micro_batches, plan_packing

DEFAULT_GROUP_ID_KEY = "prompt_id"
PER_TOKEN_KEYS = ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs")


class NemoRLBatchError(ValueError):
    """A NeMo-RL batch that cannot be deduplicated as given; the message names the rows."""


def _rows_text(rows: Sequence[int], limit: int = 8) -> str:
    rows = list(rows)
    head = ", ".join(map(str, rows[:limit]))
    return f"[{head}{', ...' if len(rows) > limit else ''}]"


@dataclass(frozen=True)
class EdgeIndex:
    """Where the loss edges of one micro-batch sit in the [B, S] batch (layout edge order)."""

    row: Tensor  # int64 [E]
    col: Tensor  # int64 [E]: the token's column (its logprob's column in NeMo-RL's convention)
    response_row: Tensor  # int64 [M]: the batch row of each response of the micro-batch


@dataclass(frozen=True)
class NemoRLBatch:
    """A validated NeMo-RL batch with its groups (see the module docstring).

    records[g] holds group g (prompt and responses as token ids); rows[g][i] is the batch row of
    its response i. prompt_lengths / lengths are per row.
    """

    data: Mapping[str, Any]
    records: tuple[RolloutGroup, ...]
    rows: tuple[tuple[int, ...], ...]
    prompt_lengths: tuple[int, ...]
    lengths: tuple[int, ...]
    batch_size: int
    seq_len: int
    empty_rows: tuple[int, ...] = ()  # rows without a generated token: not packed, logprobs 0
    claimed_groups: tuple[tuple[int, ...], ...] = ()  # every group's rows, empty rows included
    _row_values: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_groups(self) -> int:
        return len(self.records)

    def packed_tokens(self, rows: Sequence[int]) -> int:
        """P + sum(R) of rows that share a prompt (empty rows add nothing)."""
        full = [b for b in rows if self.prompt_lengths[b] < self.lengths[b]]
        if not full:
            return 0
        return self.prompt_lengths[full[0]] + sum(self.lengths[b] - self.prompt_lengths[b] for b in full)

    # -- per micro-batch ------------------------------------------------------------------------
    def edge_index(self, mb: MicroBatch) -> EdgeIndex:
        resp_rows = torch.tensor([self.rows[rec][i] for rec, i in mb.response_source], dtype=torch.int64)
        first = torch.tensor(self.prompt_lengths, dtype=torch.int64)[resp_rows]
        count = torch.tensor(self.lengths, dtype=torch.int64)[resp_rows] - first
        total = int(count.sum())
        if total != mb.layout.num_edges:  # the layout packs exactly these response tokens
            raise AssertionError(f"micro-batch {mb.index}: {total} response tokens, layout has {mb.layout.num_edges} edges")
        # edge e of response m sits at column first[m] + (e - start of m)
        starts = torch.cumsum(count, 0) - count
        col = torch.arange(total) + torch.repeat_interleave(first - starts, count)
        return EdgeIndex(row=torch.repeat_interleave(resp_rows, count), col=col, response_row=resp_rows)

    def edge_values(self, key: str, index: EdgeIndex, device=None) -> Tensor:
        """[E] values of a per-token [B, S] key at the micro-batch's edges."""
        x = self.data[key]
        if not isinstance(x, Tensor) or tuple(x.shape) != (self.batch_size, self.seq_len):
            raise NemoRLBatchError(f"{key}: expected a tensor [B, S] = [{self.batch_size}, {self.seq_len}], got "
                                   f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        out = x[index.row.to(x.device), index.col.to(x.device)]
        return out if device is None else out.to(device)

    def response_values(self, key: str, index: EdgeIndex, device=None) -> Tensor:
        """[M] values of a per-row key ([B], or [B, S] constant along each row's loss tokens)."""
        x = self.row_values(key)
        out = x[index.response_row.to(x.device)]
        return out if device is None else out.to(device)

    def row_values(self, key: str) -> Tensor:
        """[B] per-row values of `key`; a [B, S] key must hold one value per row on the row's loss
        tokens (token_mask != 0), as NeMo-RL's GRPO advantages do (a row scalar expanded). Checked
        once per key and batch."""
        if key not in self._row_values:
            self._row_values[key] = self._per_row(key)
        return self._row_values[key]

    def _per_row(self, key: str) -> Tensor:
        x = self.data[key]
        if not isinstance(x, Tensor):
            x = torch.as_tensor(x)
        if x.dim() == 1 and x.shape[0] == self.batch_size:
            return x
        if tuple(x.shape) != (self.batch_size, self.seq_len):
            raise NemoRLBatchError(f"{key}: expected shape [B] = [{self.batch_size}] or [B, S] = "
                                   f"[{self.batch_size}, {self.seq_len}], got {tuple(x.shape)}")
        first = torch.tensor(self.prompt_lengths, dtype=torch.int64, device=x.device).clamp(max=self.seq_len - 1)
        per_row = x.gather(1, first[:, None]).squeeze(1)  # empty rows: any value (never read)
        mask = self.data["token_mask"].to(x.device) != 0
        differs = mask & (x != per_row[:, None])
        if bool(differs.any()):
            b, t = (int(v) for v in differs.nonzero()[0])
            raise NemoRLBatchError(
                f"{key}: row {b} holds different values on its generated tokens (column {t}: {float(x[b, t])}, "
                f"column {self.prompt_lengths[b]}: {float(per_row[b])}); only one {key} value per response is "
                f"supported (per-token values are not)")
        return per_row

    # -- back to [B, S] -------------------------------------------------------------------------
    def to_sequences(self, pieces: Sequence[tuple[EdgeIndex, Tensor]], dtype=torch.float32, device=None) -> Tensor:
        """Per-edge values of every micro-batch -> [B, S] (NeMo-RL's convention, 0 elsewhere).
        Every response of the batch must be covered exactly once (empty rows: never)."""
        pieces = list(pieces)
        if device is None:
            device = pieces[0][1].device if pieces else "cpu"
        out = torch.zeros(self.batch_size, self.seq_len, dtype=dtype, device=device)
        seen = torch.zeros(self.batch_size, dtype=torch.int64)
        for index, values in pieces:
            if values.shape != index.row.shape:
                raise ValueError(f"expected {index.row.numel()} per-edge values, got {tuple(values.shape)}")
            out[index.row.to(device), index.col.to(device)] = values.detach().to(device, dtype)
            seen.index_add_(0, index.response_row, torch.ones_like(index.response_row))
        expected = torch.ones_like(seen)
        expected[list(self.empty_rows)] = 0
        if bool((seen != expected).any()):
            b = int((seen != expected).nonzero()[0, 0])
            raise ValueError(f"row {b} was covered {int(seen[b])} times by the micro-batches (expected {int(expected[b])})")
        return out


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def _tensor(data: Mapping[str, Any], key: str) -> Tensor:
    if key not in data:
        raise NemoRLBatchError(f"the batch has no {key!r} (keys: {sorted(data.keys())})")
    x = data[key]
    return x if isinstance(x, Tensor) else torch.as_tensor(x)


def _row_spans(data: Mapping[str, Any]) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """Validate input_ids / input_lengths / token_mask; (input_ids on CPU, prompt lengths, lengths).
    A row without a generated token gets prompt length = length (no response)."""
    ids = _tensor(data, "input_ids")
    if ids.dim() != 2 or ids.is_floating_point():
        raise NemoRLBatchError(f"input_ids: expected integer token ids [B, S], got {ids.dtype} {tuple(ids.shape)}")
    B, S = ids.shape
    if B == 0 or S == 0:
        raise NemoRLBatchError(f"input_ids: empty batch {tuple(ids.shape)}")
    lengths = _tensor(data, "input_lengths").reshape(-1).cpu()
    if lengths.shape[0] != B:
        raise NemoRLBatchError(f"input_lengths: expected {B} lengths (one per row), got {lengths.shape[0]}")
    if lengths.is_floating_point() and bool((lengths != lengths.round()).any()):
        raise NemoRLBatchError("input_lengths: must be integers")
    lengths = lengths.long()
    bad = ((lengths < 2) | (lengths > S)).nonzero().flatten().tolist()
    if bad:
        raise NemoRLBatchError(f"input_lengths: rows {_rows_text(bad)} have lengths "
                               f"{_rows_text(lengths[bad].tolist())} outside [2, S={S}] (a row needs a prompt token and a "
                               f"generated token, and fits the padded width S)")
    mask = _tensor(data, "token_mask").cpu()
    if tuple(mask.shape) != (B, S):
        raise NemoRLBatchError(f"token_mask: expected shape [B, S] = [{B}, {S}], got {tuple(mask.shape)}")
    cols = torch.arange(S)[None, :]
    inside = cols < lengths[:, None]
    generated = (mask != 0)
    beyond = (generated & ~inside).any(1).nonzero().flatten().tolist()
    if beyond:
        raise NemoRLBatchError(f"token_mask: rows {_rows_text(beyond)} mark tokens at or after input_lengths as "
                               f"generated (padding must have token_mask 0)")
    generated &= inside
    has_response = generated.any(1)
    first = generated.int().argmax(1)  # first generated column = prompt length
    at0 = (has_response & (first == 0)).nonzero().flatten().tolist()
    if at0:
        raise NemoRLBatchError(f"token_mask: rows {_rows_text(at0)} mark token 0 as generated (no prompt before it)")
    # rows without a generated token: prompt length = length (empty response span)
    first = torch.where(has_response, first, lengths)
    return ids.cpu(), tuple(first.tolist()), tuple(lengths.tolist())


def _group_ids(data: Mapping[str, Any], key: str, B: int) -> list[Any]:
    raw = data[key]
    if isinstance(raw, Tensor):
        if raw.dim() != 1 or raw.is_floating_point():
            raise NemoRLBatchError(f"{key}: expected one integer id per row [B], got {raw.dtype} {tuple(raw.shape)}")
        ids = raw.tolist()
    else:
        ids = list(raw)
    if len(ids) != B:
        raise NemoRLBatchError(f"{key}: expected {B} ids (one per row), got {len(ids)}")
    for b, x in enumerate(ids):
        if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
            ids[b] = x = x.item()
        if isinstance(x, bool) or not isinstance(x, (str, int)):
            raise NemoRLBatchError(f"{key}: row {b} has id {x!r}; ids must be strings or integers")
    return ids


def _check_group(ids: Tensor, prompt_lengths: Sequence[int], rows: Sequence[int], what: str) -> None:
    """Every row of a claimed group has the first row's prompt (boundary and tokens)."""
    b0 = rows[0]
    p = prompt_lengths[b0]
    for b in rows[1:]:
        if prompt_lengths[b] != p:
            raise NemoRLBatchError(
                f"{what}: rows {_rows_text(rows)} are claimed to share one prompt, but row {b}'s first generated "
                f"token (token_mask) is at column {prompt_lengths[b]} and row {b0}'s at column {p}")
        diff = (ids[b, :p] != ids[b0, :p]).nonzero().flatten()
        if diff.numel():
            t = int(diff[0])
            raise NemoRLBatchError(
                f"{what}: rows {_rows_text(rows)} are claimed to share one prompt, but row {b} differs from row {b0} "
                f"at prompt token {t} (ids {int(ids[b, t])} and {int(ids[b0, t])})")


def convert_batch(data: Mapping[str, Any], *, num_generations_per_prompt: Optional[int] = None,
                  group_id_key: Optional[str] = DEFAULT_GROUP_ID_KEY) -> NemoRLBatch:
    """Validate a NeMo-RL batch and find its groups (see the module docstring)."""
    ids, prompt_lengths, lengths = _row_spans(data)
    B, S = ids.shape
    if group_id_key is not None and group_id_key in data:
        gids = _group_ids(data, group_id_key, B)
        members: dict[Any, list[int]] = {}
        for b, g in enumerate(gids):
            members.setdefault(g, []).append(b)
        groups = [(f"{group_id_key}={g!r}", rows) for g, rows in members.items()]
    else:
        n = num_generations_per_prompt
        if n is None:
            raise NemoRLBatchError(
                f"no group identity: the batch has no {group_id_key!r} column and num_generations_per_prompt "
                f"is not set (give one of them; rows are never grouped by guessing)")
        if not isinstance(n, int) or n < 1:
            raise NemoRLBatchError(f"num_generations_per_prompt must be a positive integer, got {n!r}")
        if B % n:
            raise NemoRLBatchError(
                f"{B} rows are not a whole number of groups of num_generations_per_prompt={n} consecutive copies "
                f"(rows {_rows_text(range(B - B % n, B))} are left over); with data parallelism each rank's share "
                f"must be a multiple of {n}")
        groups = [(f"rows {k}..{k + n - 1}", list(range(k, k + n))) for k in range(0, B, n)]

    records, rows = [], []
    empty = tuple(b for b in range(B) if prompt_lengths[b] == lengths[b])
    for name, members_ in groups:
        members_ = [b for b in members_ if prompt_lengths[b] < lengths[b]]
        if not members_:
            continue
        _check_group(ids, prompt_lengths, members_, name)
        b0 = members_[0]
        prompt = ids[b0, :prompt_lengths[b0]].tolist()
        responses = [ids[b, prompt_lengths[b]:lengths[b]].tolist() for b in members_]
        records.append(RolloutGroup(name, prompt, responses))
        rows.append(tuple(members_))
    if not records:
        raise NemoRLBatchError(f"none of the {B} rows marks a generated token (token_mask): nothing to train on")
    return NemoRLBatch(data=data, records=tuple(records), rows=tuple(rows), prompt_lengths=prompt_lengths,
                       lengths=lengths, batch_size=B, seq_len=S, empty_rows=empty,
                       claimed_groups=tuple(tuple(m) for _, m in groups))


def plan_micro_batches(batch: NemoRLBatch, *, max_tokens: int, max_attention_pairs: Optional[int] = None,
                       pad_to_multiple: int = 1, pad_token_id: int = 0, vocab_size: Optional[int] = None,
                       device="cpu") -> list[MicroBatch]:
    """Group-aware packing of one rank's batch: a group stays whole in one micro-batch when it fits
    `max_tokens` (else it is split into sub-groups that each carry the prompt); see packing.py."""
    cfg = PackingConfig(max_tokens=max_tokens, max_attention_pairs=max_attention_pairs, dp_size=1,
                        pad_to_multiple=pad_to_multiple, pad_token_id=pad_token_id, vocab_size=vocab_size,
                        shuffle=False, advantage=None)
    plan = plan_packing(batch.records, cfg)
    return build_micro_batches(batch.records, plan, 0, device=device)
