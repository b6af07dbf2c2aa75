"""Rollout data: the group record schema, its JSONL/Parquet files, flat-row conversion, advantages.

See docs/DATA.md for the schema.
"""

import os

from .advantages import AdvantageEstimator, compute_advantages
from .flat import FlatGroups, groups_from_flat, rows_from_sequences
from .io import iter_rollouts, read_rollouts, write_rollouts
from .schema import RolloutError, RolloutGroup, check_unique_ids

DEFAULT_ROLLOUTS = os.path.join(os.path.dirname(__file__), "default_rollouts.jsonl")
"""A tiny random-token rollout set shipped for the demo (vocab 512; tools/make_default_rollouts.py)."""
DEFAULT_ROLLOUTS_VOCAB_SIZE = 512

__all__ = [
    "AdvantageEstimator", "compute_advantages",
    "FlatGroups", "groups_from_flat", "rows_from_sequences",
    "iter_rollouts", "read_rollouts", "write_rollouts",
    "RolloutError", "RolloutGroup", "check_unique_ids",
    "DEFAULT_ROLLOUTS", "DEFAULT_ROLLOUTS_VOCAB_SIZE",
]
