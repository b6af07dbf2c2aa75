"""The rollout record: one GRPO group per record, validated on construction.

A record holds one prompt, its N sampled responses and what the policy update needs per response
(advantage or reward) and per response token (old-policy and reference logprobs, loss mask). Every
field is checked when the record is built, so a `RolloutGroup` that exists is well formed; errors
name the group id and the field (`RolloutError`, a ValueError).

Logprob convention: old_logprobs[i][t] = log p(responses[i][t] | prompt, responses[i][:t]), one
value per response token (no entry for prompt tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from ..layout import Group

# Keys of a record, in file order. Only group_id, prompt and responses are required.
REQUIRED_FIELDS = ("group_id", "prompt", "responses")
OPTIONAL_FIELDS = ("rewards", "advantages", "old_logprobs", "ref_logprobs", "generation_logprobs", "loss_mask")
ALL_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS
PER_TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "generation_logprobs", "loss_mask")
PER_RESPONSE_FIELDS = ("rewards", "advantages")

# A log-probability above 0 is not one (probabilities or logits passed by mistake); allow for the
# rounding of a log-softmax computed in low precision.
LOGPROB_TOLERANCE = 1e-3


class RolloutError(ValueError):
    """A rollout record that is malformed; the message names the record and the field."""


def _fail(where: str, group_id: Any, field: str, problem: str) -> RolloutError:
    gid = f"group {group_id!r}" if group_id is not None else "group (no id)"
    return RolloutError(f"{where}{gid}: {field}: {problem}")


def _to_array(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except (ValueError, OverflowError) as exc:  # ragged nesting, ints beyond int64
        raise TypeError(str(exc)) from None


class _Checker:
    """Normalises and checks the fields of one record; every error names it."""

    def __init__(self, where: str, group_id: Any):
        self.where, self.group_id = where, group_id

    def fail(self, field: str, problem: str) -> RolloutError:
        return _fail(self.where, self.group_id, field, problem)

    def ids(self, x: Any, field: str) -> tuple[int, ...]:
        if isinstance(x, (str, bytes)) or x is None:
            raise self.fail(field, f"expected a list of integer token ids, got {type(x).__name__}")
        try:
            a = _to_array(x)
        except TypeError as exc:
            raise self.fail(field, f"expected a list of integer token ids ({exc})") from None
        if a.ndim != 1:
            raise self.fail(field, f"expected a flat list of token ids, got shape {a.shape}")
        # a Python list may mix in bools or floats that numpy would silently convert (set(map(type))
        # runs in C; the element-wise scan only runs to name the culprit)
        items = x if isinstance(x, (list, tuple)) else (a.tolist() if a.dtype.kind not in "iu" else ())
        bad_type = lambda t: issubclass(t, (bool, np.bool_)) or not issubclass(t, (int, np.integer))
        bad = None
        if any(bad_type(t) for t in set(map(type, items))):
            bad = next(v for v in items if bad_type(type(v)))
        if bad is not None or (a.size and a.dtype.kind not in "iu"):
            bad = a.flat[0] if bad is None else bad
            raise self.fail(field, f"token ids must be integers, got {bad!r} ({type(bad).__name__})")
        if a.size and a.min() < 0:
            j = int(np.argmin(a))
            raise self.fail(field, f"token {j} has negative id {int(a[j])}")
        return tuple(a.tolist())

    def floats(self, x: Any, field: str, n: Optional[int], name_n: str, max_value: Optional[float] = None,
               ) -> tuple[float, ...]:
        if isinstance(x, (str, bytes)):
            raise self.fail(field, f"expected a list of numbers, got {type(x).__name__}")
        try:
            a = _to_array(x)
        except TypeError as exc:
            raise self.fail(field, f"expected a list of numbers ({exc})") from None
        if a.ndim != 1:
            raise self.fail(field, f"expected a flat list of numbers, got shape {a.shape}")
        if a.size and a.dtype.kind not in "fiu":
            raise self.fail(field, f"expected numbers, got dtype {a.dtype} (first value {a.flat[0]!r})")
        if n is not None and a.size != n:
            raise self.fail(field, f"has {a.size} values but {name_n} has {n}")
        a = a.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(a))
        if bad.size:
            raise self.fail(field, f"value {int(bad[0])} is {a[bad[0]]} (must be finite)")
        if max_value is not None and a.size and a.max() > max_value:
            j = int(np.argmax(a))
            raise self.fail(field, f"value {j} is {a[j]}, a log-probability must be <= 0")
        return tuple(a.tolist())

    def mask(self, x: Any, field: str, n: int, name_n: str) -> tuple[int, ...]:
        try:
            a = _to_array(x)
        except TypeError as exc:
            raise self.fail(field, f"expected a list of 0/1 flags ({exc})") from None
        if a.ndim != 1:
            raise self.fail(field, f"expected a flat list of 0/1 flags, got shape {a.shape}")
        if a.size != n:
            raise self.fail(field, f"has {a.size} values but {name_n} has {n}")
        if a.size and (a.dtype.kind not in "biuf" or not np.isin(a, (0, 1)).all()):
            j = int(np.flatnonzero(~np.isin(a, (0, 1)))[0]) if a.dtype.kind in "biuf" else 0
            raise self.fail(field, f"value {j} is {a.tolist()[j]!r}, the loss mask holds 0 or 1")
        return tuple(int(v) for v in a.tolist())

    def per_response(self, x: Any, field: str, n: int) -> list:
        if isinstance(x, (str, bytes, Mapping)) or not hasattr(x, "__len__"):
            raise self.fail(field, f"expected a list with one entry per response, got {type(x).__name__}")
        if len(x) != n:
            raise self.fail(field, f"has {len(x)} entries but the group has {n} responses")
        return list(x)


@dataclass(frozen=True)
class RolloutGroup:
    """One GRPO group: a prompt, N responses and their training signals (see docs/DATA.md).

    Build it with keyword arguments (lists, tuples, numpy arrays or tensors are accepted); every
    field is normalised to tuples of Python numbers and validated, so a record is always well formed.
    `where` only prefixes error messages (e.g. "rollouts.jsonl line 7: ").
    """

    group_id: str
    prompt: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]
    rewards: Optional[tuple[float, ...]] = None
    advantages: Optional[tuple[float, ...]] = None
    old_logprobs: Optional[tuple[tuple[float, ...], ...]] = None
    ref_logprobs: Optional[tuple[tuple[float, ...], ...]] = None
    generation_logprobs: Optional[tuple[tuple[float, ...], ...]] = None
    loss_mask: Optional[tuple[tuple[int, ...], ...]] = None

    def __init__(self, group_id: Any, prompt: Any, responses: Any, rewards: Any = None,
                 advantages: Any = None, old_logprobs: Any = None, ref_logprobs: Any = None,
                 generation_logprobs: Any = None, loss_mask: Any = None, *, where: str = ""):
        c = _Checker(where, group_id)
        if group_id is None or (isinstance(group_id, str) and not group_id):
            raise c.fail("group_id", "missing (every group needs an id)")
        if not isinstance(group_id, (str, int, np.integer)) or isinstance(group_id, bool):
            raise c.fail("group_id", f"expected a string or an integer, got {type(group_id).__name__}")
        gid = str(group_id)
        c.group_id = gid

        p = c.ids(prompt, "prompt")
        if not p:
            raise c.fail("prompt", "empty (its last token predicts the first token of every response)")
        if responses is None or isinstance(responses, (str, bytes)) or not hasattr(responses, "__len__"):
            raise c.fail("responses", f"expected a list of responses, got {type(responses).__name__}")
        if len(responses) == 0:
            raise c.fail("responses", "empty group (no responses)")
        rs = []
        for i, r in enumerate(responses):
            ids = c.ids(r, f"responses[{i}]")
            if not ids:
                raise c.fail(f"responses[{i}]", "empty response")
            rs.append(ids)
        n = len(rs)

        def per_response_numbers(x, field):
            if x is None:
                return None
            return c.floats(c.per_response(x, field, n), field, n, "responses")

        def per_token(x, field, kind):
            if x is None:
                return None
            out = []
            for i, v in enumerate(c.per_response(x, field, n)):
                name, target = f"{field}[{i}]", f"responses[{i}]"
                if kind == "mask":
                    out.append(c.mask(v, name, len(rs[i]), target))
                else:
                    out.append(c.floats(v, name, len(rs[i]), target, max_value=LOGPROB_TOLERANCE))
            return tuple(out)

        values = dict(
            group_id=gid, prompt=p, responses=tuple(rs),
            rewards=per_response_numbers(rewards, "rewards"),
            advantages=per_response_numbers(advantages, "advantages"),
            old_logprobs=per_token(old_logprobs, "old_logprobs", "logprob"),
            ref_logprobs=per_token(ref_logprobs, "ref_logprobs", "logprob"),
            generation_logprobs=per_token(generation_logprobs, "generation_logprobs", "logprob"),
            loss_mask=per_token(loss_mask, "loss_mask", "mask"),
        )
        for k, v in values.items():
            object.__setattr__(self, k, v)

    # -- construction from a mapping (one line of JSONL, one row of Parquet) --------------------
    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "") -> "RolloutGroup":
        if not isinstance(d, Mapping):
            raise RolloutError(f"{where}expected a record (an object with keys {', '.join(ALL_FIELDS)}), "
                               f"got {type(d).__name__}")
        unknown = sorted(set(d) - set(ALL_FIELDS))
        if unknown:
            raise _fail(where, d.get("group_id"), ", ".join(unknown),
                        f"unknown field(s); a record has {', '.join(ALL_FIELDS)}")
        for k in REQUIRED_FIELDS:
            if k not in d or d[k] is None:
                raise _fail(where, d.get("group_id"), k, "missing required field")
        return RolloutGroup(**{k: d.get(k) for k in ALL_FIELDS}, where=where)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists; absent optional fields are None."""
        as_list = lambda v: None if v is None else [list(x) if isinstance(x, tuple) else x for x in v]
        return {
            "group_id": self.group_id,
            "prompt": list(self.prompt),
            "responses": [list(r) for r in self.responses],
            **{k: as_list(getattr(self, k)) for k in OPTIONAL_FIELDS},
        }

    # -- derived -------------------------------------------------------------------------------
    @property
    def num_responses(self) -> int:
        return len(self.responses)

    @property
    def response_lengths(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.responses)

    def to_group(self) -> Group:
        return Group(prompt=self.prompt, responses=self.responses, name=self.group_id)

    def check_vocab(self, vocab_size: int, where: str = "") -> None:
        """Raise if any token id lies outside [0, vocab_size)."""
        for field, ids in [("prompt", self.prompt)] + [(f"responses[{i}]", r) for i, r in enumerate(self.responses)]:
            top = max(ids)
            if top >= vocab_size:
                j = ids.index(top)
                raise _fail(where, self.group_id, field,
                            f"token {j} has id {top}, outside the vocabulary [0, {vocab_size})")


def check_unique_ids(records: "list[RolloutGroup]", where: str = "") -> None:
    """Group ids identify groups (and are how flat rows are grouped): they must be unique."""
    seen: dict[str, int] = {}
    for i, r in enumerate(records):
        if r.group_id in seen:
            raise RolloutError(f"{where}group {r.group_id!r}: group_id: duplicate (records {seen[r.group_id]} and {i})")
        seen[r.group_id] = i
