"""`shard_placement_fn`: the FSDP2 placements a hand-built model needs to match a reshard folder.

A folder written with a balanced layout splits some expert tensors on a dim other than 0; FSDP2 shards every parameter
on dim 0 unless told otherwise. Passing this function to every `fully_shard` call gives each such parameter the
folder's `Shard(dim)`, so each rank's local tensor is exactly the chunk in its own file and `reshard.StorageReader`
reads it in place (the transformers loader patch does the same for `from_pretrained`).
"""

from __future__ import annotations

import os

from ..errors import LoadError
from ..manifest import Manifest


def shard_placement_fn(out: str | os.PathLike | Manifest, model=None):
    """The `shard_placement_fn` to pass to FSDP2's `fully_shard` so a model gets the placements `out` was written
    for: each tensor the folder splits on a dim other than 0 (balanced expert tensors) gets `Shard(dim)`, every
    other parameter FSDP2's default `Shard(0)`.

    Pass it to every `fully_shard` call (expert modules on the efsdp mesh, the others and the root on the fsdp
    mesh), after expert parallelism, if any, has made the expert parameters `Shard(0)` on the ep mesh.

    Args:
        out: the folder written by `reshard write` (or its parsed `Manifest`).
        model: the model being sharded, to name each parameter exactly. Without it, a parameter is recognised by
            its global shape, which must then name one split dim among the folder's tensors of that shape.

    Returns:
        A function `param -> Shard | None`.

    Raises:
        LoadError: the manifest cannot be read; when called without `model`, a shape with several split dims.

    Example:
        >>> fn = reshard.shard_placement_fn(out, model)  # doctest: +SKIP
        >>> fully_shard(layer.mlp.experts, mesh=expert_mesh["efsdp"], shard_placement_fn=fn)  # doctest: +SKIP
    """
    if not isinstance(out, Manifest):
        from ..read import open_folder

        out = open_folder(out).manifest  # a ManifestError is a LoadError
    return _SplitDims(out, model)


class _SplitDims:
    """`shard_placement_fn`'s function: a parameter's split dim by its name in `model`, or by its shape alone."""

    def __init__(self, manifest: Manifest, model):
        self.manifest, self.model, self.names = manifest, model, {}
        self.dims = {n: info.placement.shard_dim for n, info in manifest.tensors.items() if not info.is_replicated}
        self.by_shape: dict[tuple[int, ...], set[int]] = {}
        for name, dim in self.dims.items():
            self.by_shape.setdefault(manifest.tensors[name].shape, set()).add(dim)

    def __call__(self, param):
        from torch.distributed.tensor import Shard

        if self.model is not None:
            if id(param) not in self.names:  # EP and earlier fully_shard calls replace parameters: look again
                self.names = {id(p): n for n, p in self.model.named_parameters()}
            dim = self.dims.get(self.names.get(id(param)))
        else:
            found = self.by_shape.get(tuple(param.shape), set())
            if len(found) > 1:
                raise LoadError(f"{self.manifest.where} splits tensors of shape {list(param.shape)} on dims "
                                f"{sorted(found)}: pass the model, reshard.shard_placement_fn(out, model), to tell "
                                "them apart by name.")
            dim = next(iter(found), None)
        return Shard(dim) if dim not in (None, 0) else None
