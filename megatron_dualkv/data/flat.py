"""Flat rollouts (one row per response, as NeMo-RL and veRL keep them) -> group records, and back.

Rows are grouped by an explicit prompt/rollout id, never by token equality (which merges two
different prompts that happen to be equal and splits one prompt whose copies were tokenised
differently); the prompts inside each group are then checked to be identical. Groups come out in
the order their id first appears, responses in row order. `FlatGroups.rows` remembers the row of
every response so that per-response results can be put back in row order (`to_rows`).

`rows_from_sequences` turns NeMo-RL-style rows (one [prompt | response] sequence per row, its length,
and a token mask that is 1 on generated tokens) into the prompt/response rows this converter reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, TypeVar

import numpy as np

from ..layout import Group, LayoutError
from .schema import RolloutError, RolloutGroup, _to_array

T = TypeVar("T")

# record field -> default key of that field in a flat row
DEFAULT_KEYS = {
    "group_id": "prompt_id",
    "prompt": "prompt",
    "response": "response",
    "rewards": "reward",
    "advantages": "advantage",
    "old_logprobs": "old_logprobs",
    "ref_logprobs": "ref_logprobs",
    "generation_logprobs": "generation_logprobs",
    "loss_mask": "loss_mask",
}


@dataclass(frozen=True)
class FlatGroups:
    groups: tuple[RolloutGroup, ...]
    rows: tuple[tuple[int, ...], ...]  # rows[g][i]: the flat row of response i of group g
    num_rows: int

    def to_rows(self, per_group: Sequence[Sequence[T]]) -> list[T]:
        """Per-group, per-response values (e.g. logprobs) -> a list in flat row order."""
        if len(per_group) != len(self.groups):
            raise ValueError(f"expected values for {len(self.groups)} groups, got {len(per_group)}")
        out: list[Any] = [None] * self.num_rows
        for g, (rows, values) in enumerate(zip(self.rows, per_group)):
            if len(values) != len(rows):
                raise ValueError(f"group {self.groups[g].group_id!r}: expected {len(rows)} values "
                                 f"(one per response), got {len(values)}")
            for r, v in zip(rows, values):
                out[r] = v
        return out


def _rows_of(flat: Any) -> list[Mapping[str, Any]]:
    """A sequence of row mappings, or a mapping of equally long columns."""
    if isinstance(flat, Mapping):
        cols = {k: v for k, v in flat.items()}
        lengths = {k: len(v) for k, v in cols.items()}
        if len(set(lengths.values())) > 1:
            raise RolloutError(f"flat rollouts: columns differ in length: {lengths}")
        n = next(iter(lengths.values()), 0)
        return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    return list(flat)


def _scalar_id(x: Any, row: int, key: str) -> Any:
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (str, int)):
        raise RolloutError(f"flat row {row}: {key}: expected a string or integer id, got {x!r}")
    return x


def groups_from_flat(flat: Any, *, keys: Optional[Mapping[str, str]] = None) -> FlatGroups:
    """Group flat rows by their id into validated `RolloutGroup`s.

    flat: rows (mappings) or a mapping of columns. Each row holds the id, the prompt ids, the
    response ids and optionally a reward, an advantage, per-token old/reference logprobs and a
    per-token loss mask (unpadded, one value per response token). `keys` renames the row keys
    (see DEFAULT_KEYS), e.g. {"group_id": "uid", "prompt": "prompt_ids"} for veRL-like rows.
    An optional field must be present in every row of a group or in none.
    """
    keys = {**DEFAULT_KEYS, **(keys or {})}
    unknown = set(keys) - set(DEFAULT_KEYS)
    if unknown:
        raise ValueError(f"unknown key mapping(s) {sorted(unknown)}; known: {sorted(DEFAULT_KEYS)}")
    rows = _rows_of(flat)
    if not rows:
        raise RolloutError("flat rollouts: no rows")
    id_key = keys["group_id"]

    members: dict[Any, list[int]] = {}
    names: dict[str, Any] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise RolloutError(f"flat row {i}: expected a mapping of fields, got {type(row).__name__}")
        for k in (id_key, keys["prompt"], keys["response"]):
            if k not in row or row[k] is None:
                raise RolloutError(f"flat row {i}: missing {k!r}")
        gid = _scalar_id(row[id_key], i, id_key)
        if str(gid) in names and names[str(gid)] != gid:
            raise RolloutError(f"flat row {i}: {id_key} {gid!r} and {names[str(gid)]!r} name the same group id "
                               f"{str(gid)!r}; use one type of id")
        names[str(gid)] = gid
        members.setdefault(gid, []).append(i)

    groups, group_rows = [], []
    for gid, idx in members.items():
        where = f"flat rows {idx} ({id_key} {gid!r}): "
        try:
            g = Group.from_pairs([(rows[i][keys["prompt"]], rows[i][keys["response"]]) for i in idx],
                                 name=f"{id_key} {gid!r}")
        except LayoutError as exc:
            raise RolloutError(f"{where}{exc} (rows are numbered inside the group)") from None
        fields: dict[str, Any] = {}
        for field in ("rewards", "advantages", "old_logprobs", "ref_logprobs", "generation_logprobs", "loss_mask"):
            k = keys[field]
            have = [k in rows[i] and rows[i][k] is not None for i in idx]
            if any(have) and not all(have):
                missing = [i for i, h in zip(idx, have) if not h]
                raise RolloutError(f"{where}{k!r} is present in some rows of the group but not in rows {missing}")
            if all(have):
                vals = [rows[i][k] for i in idx]
                if field in ("rewards", "advantages"):  # one number per row; 0-d tensors and [1] arrays too
                    vals = [a.reshape(-1)[0] if (a := _to_array(v)).size == 1 else v for v in vals]
                fields[field] = vals
        groups.append(RolloutGroup(gid, g.prompt, g.responses, **fields, where=where))
        group_rows.append(tuple(idx))
    return FlatGroups(groups=tuple(groups), rows=tuple(group_rows), num_rows=len(rows))


def rows_from_sequences(input_ids: Any, input_lengths: Any, token_mask: Any, group_ids: Sequence[Any],
                        **per_token: Any) -> list[dict[str, Any]]:
    """NeMo-RL-style batch rows -> flat rows for `groups_from_flat` (default keys).

    input_ids [B, S]: [prompt | response] right-padded; input_lengths [B]; token_mask [B, S]: 1 on
    generated tokens (0 on the prompt and on tool/user turns inside a multi-turn response).
    The prompt is everything before the first generated token; the response runs from there to
    the row's length and its loss mask is token_mask over that span. per_token: [B, S] arrays in
    the sequence convention (column t = log p(token t | tokens < t)), e.g. old_logprobs=...,
    ref_logprobs=...; they are cut to the response span. Scalars per row (reward=..., advantage=...)
    may be passed as [B] arrays.
    """
    ids = _to_array(input_ids)
    lengths = _to_array(input_lengths).reshape(-1)
    mask = _to_array(token_mask)
    if ids.ndim != 2 or mask.shape != ids.shape or lengths.shape[0] != ids.shape[0]:
        raise RolloutError(f"sequences: expected input_ids and token_mask [B, S] and input_lengths [B], got "
                           f"{ids.shape}, {mask.shape}, {lengths.shape}")
    if len(group_ids) != ids.shape[0]:
        raise RolloutError(f"sequences: {len(group_ids)} group ids for {ids.shape[0]} rows")
    extra = {k: _to_array(v) for k, v in per_token.items()}
    out = []
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        if not 0 < n <= ids.shape[1]:
            raise RolloutError(f"sequence row {b}: length {n} outside [1, {ids.shape[1]}]")
        generated = np.flatnonzero(mask[b, :n])
        if generated.size == 0:
            raise RolloutError(f"sequence row {b}: token_mask marks no generated token (empty response)")
        first = int(generated[0])
        if first == 0:
            raise RolloutError(f"sequence row {b}: token_mask marks token 0 as generated (no prompt)")
        row = {
            "prompt_id": group_ids[b],
            "prompt": ids[b, :first],
            "response": ids[b, first:n],
            "loss_mask": mask[b, first:n],
        }
        for k, v in extra.items():
            if v.ndim == 2:
                if v.shape != ids.shape:
                    raise RolloutError(f"sequences: {k} has shape {v.shape}, expected {ids.shape}")
                row[k] = v[b, first:n]
            elif v.ndim == 1 and v.shape[0] == ids.shape[0]:
                row[k] = v[b]
            else:
                raise RolloutError(f"sequences: {k} must be [B, S] per token or [B] per row, got {v.shape}")
        out.append(row)
    return out
