"""Read and write rollout records as JSONL (one JSON object per line) or Parquet (one row each).

The format follows the file name: *.jsonl / *.json -> JSONL, *.parquet / *.pq -> Parquet. Readers
validate every record (errors name the file, the line or row, the group and the field) and check
that group ids are unique. pyarrow is imported only when a Parquet file is touched.

Parquet column types: prompt list<int32>, responses list<list<int32>>, rewards and advantages
list<float64>, old/ref/generation_logprobs list<list<float32>> (log-probabilities come from
bf16/fp32 models; float32 halves the file), loss_mask list<list<int8>>; absent fields are null.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, Optional, Sequence

from .schema import ALL_FIELDS, REQUIRED_FIELDS, RolloutError, RolloutGroup, check_unique_ids

SCHEMA_NAME = "megatron_dualkv.rollout_groups"
SCHEMA_VERSION = "1"


def _format_of(path: str, fmt: Optional[str]) -> str:
    if fmt is not None:
        if fmt not in ("jsonl", "parquet"):
            raise ValueError(f"rollout format must be 'jsonl' or 'parquet', got {fmt!r}")
        return fmt
    name = os.fspath(path).lower()
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise ValueError(f"{path}: cannot tell the rollout format from the name (use .jsonl or .parquet, or pass fmt=)")


# --------------------------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------------------------


def iter_jsonl(path: str) -> Iterator[RolloutGroup]:
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}: "
            try:
                # NaN/Infinity are parsed (the validator then names the field) rather than refused here
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RolloutError(f"{where}invalid JSON ({exc.msg} at column {exc.colno})") from None
            yield RolloutGroup.from_dict(obj, where=where)


def write_jsonl(records: Iterable[RolloutGroup], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            d = {k: v for k, v in rec.to_dict().items() if v is not None}
            # records are validated (finite), so strict JSON always succeeds
            f.write(json.dumps(d, separators=(",", ":"), allow_nan=False))
            f.write("\n")


# --------------------------------------------------------------------------------------------
# Parquet
# --------------------------------------------------------------------------------------------


def _arrow_schema():
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    return pa.schema(
        [
            pa.field("group_id", pa.string(), nullable=False),
            pa.field("prompt", ids, nullable=False),
            pa.field("responses", pa.list_(ids), nullable=False),
            pa.field("rewards", pa.list_(pa.float64())),
            pa.field("advantages", pa.list_(pa.float64())),
            pa.field("old_logprobs", pa.list_(pa.list_(pa.float32()))),
            pa.field("ref_logprobs", pa.list_(pa.list_(pa.float32()))),
            pa.field("generation_logprobs", pa.list_(pa.list_(pa.float32()))),
            pa.field("loss_mask", pa.list_(pa.list_(pa.int8()))),
        ],
        metadata={SCHEMA_NAME: SCHEMA_VERSION},
    )


def write_parquet(records: Iterable[RolloutGroup], path: str, row_group_size: int = 1024) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema()
    records = list(records)
    for rec in records:
        top = max(max(rec.prompt), *(max(r) for r in rec.responses))
        if top >= 2**31:
            raise RolloutError(f"group {rec.group_id!r}: token id {top} does not fit the int32 Parquet column")
    columns = {name: [getattr(rec, name) for rec in records] for name in ALL_FIELDS}
    table = pa.table({name: pa.array(columns[name], type=schema.field(name).type) for name in ALL_FIELDS},
                     schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)


def iter_parquet(path: str, batch_size: int = 256) -> Iterator[RolloutGroup]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    names = f.schema_arrow.names
    missing = [k for k in REQUIRED_FIELDS if k not in names]
    if missing:
        raise RolloutError(f"{path}: missing required column(s) {', '.join(missing)}")
    unknown = [k for k in names if k not in ALL_FIELDS]
    if unknown:
        raise RolloutError(f"{path}: unknown column(s) {', '.join(unknown)}; a record has {', '.join(ALL_FIELDS)}")
    row = 0
    for batch in f.iter_batches(batch_size=batch_size):
        for obj in batch.to_pylist():
            yield RolloutGroup.from_dict(obj, where=f"{path} row {row}: ")
            row += 1


# --------------------------------------------------------------------------------------------
# Either
# --------------------------------------------------------------------------------------------


def iter_rollouts(path: str, fmt: Optional[str] = None) -> Iterator[RolloutGroup]:
    """Stream validated records (group ids are not checked for uniqueness here)."""
    return iter_jsonl(path) if _format_of(path, fmt) == "jsonl" else iter_parquet(path)


def read_rollouts(path: str, fmt: Optional[str] = None, vocab_size: Optional[int] = None) -> list[RolloutGroup]:
    """All records of a file, validated; unique group ids; ids inside [0, vocab_size) when given."""
    records = list(iter_rollouts(path, fmt))
    if not records:
        raise RolloutError(f"{path}: no rollout records")
    check_unique_ids(records, where=f"{path}: ")
    if vocab_size is not None:
        for i, rec in enumerate(records):
            rec.check_vocab(vocab_size, where=f"{path} record {i}: ")
    return records


def write_rollouts(records: Sequence[RolloutGroup], path: str, fmt: Optional[str] = None) -> None:
    records = list(records)
    check_unique_ids(records)
    if _format_of(path, fmt) == "jsonl":
        write_jsonl(records, path)
    else:
        write_parquet(records, path)
