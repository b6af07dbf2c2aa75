"""The one description of a packed DualKV micro-batch.

A micro-batch packs several GRPO groups, each as

    [ prompt (P) | response 1 (R_1) | ... | response N (R_N) ]

into one token sequence. The packer (`build_layout`) turns groups of token ids into a
`PackedLayout`; the attention backends, the Megatron model, the logprob gather and the loss all
read it and nothing else.

The attention structure is a forest of contiguous segments (`SegmentTable`): a query token of
segment s sees every token of the ancestors of s and the tokens of s up to itself. A GRPO group is
a tree of depth 2 (prompt = root, responses = children); deeper trees (multi-turn, branching
rollouts) fit the same description, although the fused kernels accept depth 2 only for now.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor


class LayoutError(ValueError):
    """A group or micro-batch that cannot be packed; the message names the group."""


# --------------------------------------------------------------------------------------------
# Input: groups of token ids
# --------------------------------------------------------------------------------------------


def _as_id_tuple(ids: Any, what: str) -> tuple[int, ...]:
    if isinstance(ids, Tensor):
        if ids.dim() != 1:
            raise LayoutError(f"{what}: expected a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        if ids.is_floating_point():
            raise LayoutError(f"{what}: token ids must be integers, got dtype {ids.dtype}")
        return tuple(int(x) for x in ids.tolist())
    try:
        out = tuple(int(x) for x in ids)
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"{what}: expected a sequence of integer token ids ({exc})") from None
    for x, y in zip(ids, out):
        if isinstance(x, float) and x != y:
            raise LayoutError(f"{what}: token ids must be integers, got {x!r}")
    return out


@dataclass(frozen=True)
class Group:
    """One GRPO group: a prompt and the N responses sampled from it (token ids)."""

    prompt: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]
    name: Optional[str] = None  # e.g. the rollout/prompt id; used in error messages

    @staticmethod
    def of(prompt: Any, responses: Iterable[Any], name: Optional[str] = None) -> "Group":
        label = name if name is not None else "group"
        return Group(
            prompt=_as_id_tuple(prompt, f"{label} prompt"),
            responses=tuple(_as_id_tuple(r, f"{label} response {i}") for i, r in enumerate(responses)),
            name=name,
        )

    @staticmethod
    def from_pairs(pairs: Iterable[tuple[Any, Any]], name: Optional[str] = None) -> "Group":
        """Build a group from replicated (prompt, response) rows, checking the prompts match."""
        pairs = list(pairs)
        label = name if name is not None else "group"
        if not pairs:
            raise LayoutError(f"{label}: no (prompt, response) rows")
        prompt = _as_id_tuple(pairs[0][0], f"{label} prompt of row 0")
        responses = []
        for i, (p, r) in enumerate(pairs):
            other = _as_id_tuple(p, f"{label} prompt of row {i}")
            if other != prompt:
                first = next(
                    (j for j, (a, b) in enumerate(zip(prompt, other)) if a != b),
                    min(len(prompt), len(other)),
                )
                raise LayoutError(
                    f"{label}: prompts are not identical inside the group: row {i} differs from "
                    f"row 0 at token {first} (lengths {len(other)} and {len(prompt)})"
                )
            responses.append(_as_id_tuple(r, f"{label} response {i}"))
        return Group(prompt=prompt, responses=tuple(responses), name=name)

    def label(self, index: int) -> str:
        return f"group {index}" + (f" ({self.name})" if self.name is not None else "")

    @property
    def num_responses(self) -> int:
        return len(self.responses)

    @property
    def num_packed_tokens(self) -> int:
        return len(self.prompt) + sum(len(r) for r in self.responses)

    @property
    def num_replicated_tokens(self) -> int:
        return sum(len(self.prompt) + len(r) for r in self.responses)


# --------------------------------------------------------------------------------------------
# Output: the layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentTable:
    """Contiguous segments covering [0, num_tokens): what every attention backend reads.

    Query token i of segment s attends every token of each ancestor of s, and the tokens j of s
    with j <= i. Root segments have parent -1. `depth` is the longest root-to-leaf path (a GRPO
    group has depth 2).
    """

    start: Tensor  # int32 [S]
    length: Tensor  # int32 [S]
    parent: Tensor  # int32 [S], -1 for roots
    host_start: tuple[int, ...]
    host_length: tuple[int, ...]
    host_parent: tuple[int, ...]
    num_tokens: int
    max_length: int
    depth: int
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_host(start: Sequence[int], length: Sequence[int], parent: Sequence[int],
                  device: torch.device | str = "cpu") -> "SegmentTable":
        start, length, parent = tuple(start), tuple(length), tuple(parent)
        if not (len(start) == len(length) == len(parent)) or not start:
            raise LayoutError("segment table: start, length and parent must be non-empty and equal in size")
        pos = 0
        depth = 1
        depths = []
        for s, (a, n, p) in enumerate(zip(start, length, parent)):
            if a != pos or n <= 0:
                raise LayoutError(f"segment {s}: segments must be contiguous and non-empty (start {a}, length {n}, expected start {pos})")
            if not (-1 <= p < s):
                raise LayoutError(f"segment {s}: parent {p} must be -1 or an earlier segment")
            d = 1 if p < 0 else depths[p] + 1
            depths.append(d)
            depth = max(depth, d)
            pos += n
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
        return SegmentTable(
            start=as_t(start), length=as_t(length), parent=as_t(parent),
            host_start=start, host_length=length, host_parent=parent,
            num_tokens=pos, max_length=max(length), depth=depth,
        )

    @staticmethod
    def from_group_lengths(groups: Sequence[tuple[int, Sequence[int]]], pad: int = 0,
                           device: torch.device | str = "cpu") -> "SegmentTable":
        """Segments of packed GRPO groups given by their lengths, [(P, [R_1, ..., R_N]), ...],
        followed by a padding root of `pad` tokens when pad > 0 (kernel tests and benchmarks)."""
        start, length, parent = [], [], []
        pos = 0
        for p, rs in groups:
            root = len(start)
            for n, par in [(p, -1)] + [(r, root) for r in rs]:
                start.append(pos); length.append(n); parent.append(par); pos += n
        if pad:
            start.append(pos); length.append(pad); parent.append(-1)
        return SegmentTable.from_host(start, length, parent, device=device)

    @property
    def num_segments(self) -> int:
        return len(self.host_start)

    def tree_ranges(self) -> list[tuple[int, int]]:
        """Token ranges [lo, hi) of the segment trees: a root and its descendants are contiguous."""
        roots = [self.host_start[s] for s, p in enumerate(self.host_parent) if p < 0]
        return list(zip(roots, roots[1:] + [self.num_tokens]))

    @property
    def device(self) -> torch.device:
        return self.start.device

    def to(self, device: torch.device | str) -> "SegmentTable":
        return dataclasses.replace(
            self, start=self.start.to(device), length=self.length.to(device),
            parent=self.parent.to(device), _cache={},
        )

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Per-micro-batch memo for backend metadata (block masks, tile schedules): built once,
        reused by every layer."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def ancestors(self, s: int) -> list[int]:
        out = []
        p = self.host_parent[s]
        while p >= 0:
            out.append(p)
            p = self.host_parent[p]
        return out

    def token_segment_ids(self) -> Tensor:
        """int64 [T]: the segment of every token."""
        return torch.repeat_interleave(
            torch.arange(self.num_segments, device=self.device), self.length.long()
        )


@dataclass(frozen=True)
class PackedLayout:
    """Everything about one packed micro-batch, on one device.

    Token-level tensors have length `num_tokens` (padding included). Responses are numbered
    across the micro-batch in packing order (group-major). Loss edges are ordered response-major,
    token order inside a response: edge e predicts token `target_ids[e]` (packed row
    `target_rows[e]`) from the hidden state of packed row `source_rows[e]`; the first token of
    every response is predicted by the last row of its group's prompt, shared by the N responses.
    """

    segments: SegmentTable
    input_ids: Tensor  # int64 [T]
    position_ids: Tensor  # int64 [T] rotary positions: prompt 0..P-1, response P..P+R_i-1
    token_weight: Tensor  # float32 [T] copies of each token in the replicated batch (N, 1, 0 for pad)
    padding_mask: Tensor  # bool [T] True on padding
    # groups
    group_prompt_segment: tuple[int, ...]
    group_response_segments: tuple[tuple[int, ...], ...]
    group_names: tuple[Optional[str], ...]
    # responses (flattened over groups)
    response_group: Tensor  # int64 [M]
    response_lengths: tuple[int, ...]
    # loss edges
    source_rows: Tensor  # int64 [E]
    target_rows: Tensor  # int64 [E]
    target_ids: Tensor  # int64 [E]
    edge_response: Tensor  # int64 [E]
    num_real_tokens: int
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.segments.num_tokens

    @property
    def num_groups(self) -> int:
        return len(self.group_prompt_segment)

    @property
    def num_responses(self) -> int:
        return len(self.response_lengths)

    @property
    def num_edges(self) -> int:
        return int(self.source_rows.numel())

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def response_edge_offsets(self) -> tuple[int, ...]:
        """Edges of response m are [offsets[m], offsets[m+1])."""
        out = [0]
        for n in self.response_lengths:
            out.append(out[-1] + n)
        return tuple(out)

    def group_num_responses(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.group_response_segments)

    def replicated_num_tokens(self) -> int:
        """Tokens the replicated batch ([prompt|response] per response) would hold."""
        total = 0
        for g, resp in enumerate(self.group_response_segments):
            p = self.segments.host_length[self.group_prompt_segment[g]]
            total += sum(p + self.segments.host_length[s] for s in resp)
        return total

    # -- device and per-backend caches --------------------------------------------------------
    def to(self, device: torch.device | str) -> "PackedLayout":
        device = torch.device(device)
        if device == self.device:
            return self
        moved = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                moved[f.name] = v.to(device)
        moved["segments"] = self.segments.to(device)
        moved["_cache"] = {}
        return dataclasses.replace(self, **moved)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Per-micro-batch memo for derived values (rotary tables, gathered indices)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def build_layout(
    groups: Sequence[Group | tuple],
    *,
    vocab_size: Optional[int] = None,
    max_tokens: Optional[int] = None,
    pad_to_multiple: int = 1,
    pad_token_id: int = 0,
    device: torch.device | str = "cpu",
) -> PackedLayout:
    """Pack groups into one micro-batch and validate them.

    groups: `Group`s or (prompt_ids, [response_ids, ...]) pairs.
    vocab_size: when given, every id must lie in [0, vocab_size).
    max_tokens: token budget of the micro-batch (before padding); exceeding it is an error.
    pad_to_multiple: pad the packed length to this multiple (TP sequence parallel: tp; CP: 2*cp).
    """
    if pad_to_multiple < 1:
        raise LayoutError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    groups = [g if isinstance(g, Group) else Group.of(*g) for g in groups]
    if not groups:
        raise LayoutError("a micro-batch needs at least one group")

    seg_start, seg_len, seg_parent = [], [], []
    input_ids, positions, weights = [], [], []
    group_prompt_segment, group_response_segments = [], []
    response_group, response_lengths = [], []
    src, tgt_rows, tgt_ids, edge_resp = [], [], [], []

    for gi, g in enumerate(groups):
        label = g.label(gi)
        if len(g.prompt) == 0:
            raise LayoutError(f"{label}: empty prompt (its last token predicts every first response token)")
        if g.num_responses == 0:
            raise LayoutError(f"{label}: no responses")
        for ri, r in enumerate(g.responses):
            if len(r) == 0:
                raise LayoutError(f"{label}: response {ri} is empty")
        if vocab_size is not None:
            for what, ids in [("prompt", g.prompt)] + [(f"response {i}", r) for i, r in enumerate(g.responses)]:
                bad = next(((j, x) for j, x in enumerate(ids) if not 0 <= x < vocab_size), None)
                if bad is not None:
                    raise LayoutError(
                        f"{label}: {what} token {bad[0]} has id {bad[1]}, outside the vocabulary [0, {vocab_size})"
                    )

        n, p = g.num_responses, len(g.prompt)
        prompt_seg = len(seg_start)
        prompt_start = len(input_ids)
        seg_start.append(prompt_start)
        seg_len.append(p)
        seg_parent.append(-1)
        input_ids.extend(g.prompt)
        positions.extend(range(p))
        weights.extend([float(n)] * p)
        resp_segs = []
        for r in g.responses:
            s = len(seg_start)
            start = len(input_ids)
            seg_start.append(start)
            seg_len.append(len(r))
            seg_parent.append(prompt_seg)
            resp_segs.append(s)
            input_ids.extend(r)
            positions.extend(range(p, p + len(r)))
            weights.extend([1.0] * len(r))
            m = len(response_lengths)
            response_group.append(gi)
            response_lengths.append(len(r))
            # token 0 is predicted by the last prompt row, token t>0 by the row before it
            src.append(prompt_start + p - 1)
            src.extend(range(start, start + len(r) - 1))
            tgt_rows.extend(range(start, start + len(r)))
            tgt_ids.extend(r)
            edge_resp.extend([m] * len(r))
        group_prompt_segment.append(prompt_seg)
        group_response_segments.append(tuple(resp_segs))

    num_real = len(input_ids)
    if max_tokens is not None and num_real > max_tokens:
        sizes = ", ".join(f"{g.label(i)}: {g.num_packed_tokens}" for i, g in enumerate(groups))
        raise LayoutError(
            f"micro-batch holds {num_real} packed tokens, over its budget of {max_tokens} ({sizes})"
        )
    pad = (-num_real) % pad_to_multiple
    if pad:
        # Padding is its own root segment: it attends only itself, has no loss edges and weight 0.
        seg_start.append(num_real)
        seg_len.append(pad)
        seg_parent.append(-1)
        input_ids.extend([pad_token_id] * pad)
        positions.extend(range(pad))
        weights.extend([0.0] * pad)

    long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)
    padding_mask = torch.zeros(num_real + pad, dtype=torch.bool, device=device)
    padding_mask[num_real:] = True
    return PackedLayout(
        segments=SegmentTable.from_host(seg_start, seg_len, seg_parent, device=device),
        input_ids=long(input_ids),
        position_ids=long(positions),
        token_weight=torch.tensor(weights, dtype=torch.float32, device=device),
        padding_mask=padding_mask,
        group_prompt_segment=tuple(group_prompt_segment),
        group_response_segments=tuple(group_response_segments),
        group_names=tuple(g.name for g in groups),
        response_group=long(response_group),
        response_lengths=tuple(response_lengths),
        source_rows=long(src),
        target_rows=long(tgt_rows),
        target_ids=long(tgt_ids),
        edge_response=long(edge_resp),
        num_real_tokens=num_real,
    )
