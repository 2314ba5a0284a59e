"""Load: the loader patch and `reshard.from_pretrained`, the ranks' agreement to load, the DCP storage reader,
own-file reads, and meta-only materialization.

Its interface is `__all__`, imported from the package (`from reshard.load import X`); its modules are private
(`_name.py`) and used inside `load` only. Each name is imported from its module on first use (PEP 562), so a user of one
name does not import the others' dependencies (torch, numpy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # the names for static tools; at run time each comes on first use
    from ._hooks import TESTED_RANGE, UntestedTransformersWarning, check_hooks, in_tested_range, minor_of
    from ._loader import from_pretrained
    from ._materialize import (MaterializeReport, check_buffers, materialize_meta_, meta_only_to_empty,
                               patch_megatron_fsdp, patch_to_empty, unpatch_to_empty)
    from ._patch import patch_transformers, unpatch_transformers
    from ._shard_placement import shard_placement_fn
    from ._storage import StorageReader

_EXPORTS = {
    "MaterializeReport": "_materialize",
    "StorageReader": "_storage",
    "TESTED_RANGE": "_hooks",
    "UntestedTransformersWarning": "_hooks",
    "check_buffers": "_materialize",
    "check_hooks": "_hooks",
    "from_pretrained": "_loader",
    "in_tested_range": "_hooks",
    "materialize_meta_": "_materialize",
    "meta_only_to_empty": "_materialize",
    "minor_of": "_hooks",
    "patch_megatron_fsdp": "_materialize",
    "patch_to_empty": "_materialize",
    "patch_transformers": "_patch",
    "shard_placement_fn": "_shard_placement",
    "unpatch_to_empty": "_materialize",
    "unpatch_transformers": "_patch",
}

__all__ = [
    "MaterializeReport", "StorageReader", "TESTED_RANGE", "UntestedTransformersWarning", "check_buffers", "check_hooks",
    "from_pretrained", "in_tested_range", "materialize_meta_", "meta_only_to_empty", "minor_of", "patch_megatron_fsdp",
    "patch_to_empty", "patch_transformers", "shard_placement_fn", "unpatch_to_empty", "unpatch_transformers",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
