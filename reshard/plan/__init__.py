"""Plan: the model's tensors, the mesh, where each tensor's chunks go (stock and balanced), and which chunks
each output file holds. Pure: no torch, no I/O.

Its interface is `__all__`, imported from the package (`from reshard.plan import X`); its modules are private
(`_name.py`) and used inside `plan` only.
"""

from ._dtypes import DTYPE_BITS
from ._files import ChunkSpec, check_max_shard_size, coordinate_chunks, coordinate_key, coordinate_sizes, split_parts
from ._layout import (MergeLayout, ModelLayout, Piece, Role, TargetTensor, is_router, layout_from_dict, layout_to_dict,
                      role_of, whole_tensor)
from ._mesh import MeshSpec, ranks_text
from ._placement import (Box, Kind, LayoutMode, Placement, ReshardPlan, box_is_empty, coordinate_boxes, local_box,
                         make_plan, summarize)
from ._ranks import RankSpans
from ._report import PLAN_JSON_VERSION, human_bytes, plan_to_dict, render_plan

__all__ = [
    "Box", "ChunkSpec", "DTYPE_BITS", "Kind", "LayoutMode", "MergeLayout", "MeshSpec", "ModelLayout",
    "PLAN_JSON_VERSION", "Piece", "Placement", "RankSpans", "ReshardPlan", "Role", "TargetTensor", "box_is_empty",
    "check_max_shard_size", "coordinate_boxes", "coordinate_chunks", "coordinate_key", "coordinate_sizes",
    "human_bytes", "is_router", "layout_from_dict", "layout_to_dict", "local_box", "make_plan", "plan_to_dict",
    "ranks_text", "render_plan", "role_of", "split_parts", "summarize", "whole_tensor",
]
