"""megatron_dualkv: shared-prompt deduplicated GRPO/DAPO policy updates for Megatron-Core."""

from .layout import Group, LayoutError, PackedLayout, SegmentTable, build_layout

__version__ = "0.1.0"

__all__ = ["Group", "LayoutError", "PackedLayout", "SegmentTable", "build_layout", "__version__"]
