"""DualKV attention: entry point and backends."""

from .attention import BACKENDS, backend_status, dualkv_attention, select_backend
from .reference import reference_attention

__all__ = ["BACKENDS", "backend_status", "dualkv_attention", "reference_attention", "select_backend"]
