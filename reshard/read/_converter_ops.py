"""A converter's ops as `Piece` offsets: how transformers builds one in-memory tensor from on-disk keys, replayed
slice by slice.

transformers' conversion mapping builds a tensor with ops applied in order (`MergeModulelist` stacks per-expert
keys, `Concatenate` joins projections). reshard never runs them: `compose_pieces` turns each accepted op into
offsets, so every on-disk tensor lands as a whole block of the target and its bytes are copied as they are. Only
the ops that compose that way are accepted; any other is refused by name, with the reason where the name alone
does not say it (a fused tensor transformers splits, experts it dequantizes while loading).
"""

from __future__ import annotations

import math

from ..errors import ArchitectureError, CheckpointError
from ..plan import Piece


def compose_pieces(name, shape, groups, by_pattern, index, model_type) -> list[Piece]:
    """Turn one converter's collected keys into pieces, following its ops in order."""
    if None in groups:  # renamed only: one source, same shape
        (key,) = groups[None][:1] if len(groups[None]) == 1 else _ambiguous(name, groups[None])
        pieces = [Piece(key, (0,) * len(shape))]
        _check_cover(name, shape, pieces, index)
        return pieces
    converter = by_pattern[next(iter(groups))]
    blocks, extents, step = _blocks(name, converter, groups, index)
    concat_dim, transpose_ok, unpad = _later_ops(name, converter, step, model_type)
    pieces, cursor, pattern = [], 0, None
    for pattern in converter.source_patterns:
        for key, stack_index, stacked_dim in blocks[pattern]:
            offset = [0] * len(shape)
            if stacked_dim is not None:
                offset[stacked_dim] = stack_index
            if concat_dim is not None:
                offset[concat_dim] += cursor
            pieces.append(Piece(key, tuple(offset), stacked_dim))
        if concat_dim is not None and pattern in extents:
            cursor += extents[pattern][concat_dim]
    stored = tuple(extents[pattern]) if pattern in extents else shape
    if transpose_ok and concat_dim is None and stored != shape:
        raise ArchitectureError(f"{model_type}: {name} is stored transposed ({list(stored)} on disk, "
                                f"{list(shape)} in memory); transposing is not supported yet.")
    if unpad and stored != shape:
        raise ArchitectureError(f"{model_type}: {name} is stored padded ({list(stored)} on disk, {list(shape)} in "
                                "memory; transformers drops the padding rows on load); reshard builds tensors from "
                                "whole on-disk tensors, so this checkpoint is not supported yet. Nothing was written.")
    _check_cover(name, shape, pieces, index)
    return pieces


def _blocks(name, converter, groups, index) -> tuple[dict, dict, int]:
    """Per source pattern, its keys as `(key, stack index, stacked dim)` and its block's extent; and how many of the
    converter's ops that took (1 for a leading `MergeModulelist`, which stacks the keys, else 0)."""
    ops = list(converter.operations)
    stacking = bool(ops) and type(ops[0]).__name__ == "MergeModulelist"
    blocks, extents = {}, {}
    for pattern in converter.source_patterns:
        keys = groups.get(pattern, [])
        if not keys:
            blocks[pattern] = []
            continue
        extent = list(index.tensors[keys[0]].shape)
        if stacking:
            blocks[pattern] = [(key, i, ops[0].dim) for i, key in enumerate(keys)]
            extent.insert(ops[0].dim, len(keys))
        else:
            if len(keys) > 1:
                _ambiguous(name, keys)
            blocks[pattern] = [(keys[0], None, None)]
        extents[pattern] = extent
    return blocks, extents, int(stacking)


def _later_ops(name, converter, step: int, model_type) -> tuple[int | None, bool, bool]:
    """What the ops after `step` do: (the `Concatenate` dim or None, a shape-checked `Transpose`, Inkling 2's
    `UnpadVocab`); any other op is refused by name."""
    ops = list(converter.operations)

    def takes(kind: str, ok=lambda op: True) -> bool:
        nonlocal step
        if step < len(ops) and type(ops[step]).__name__ == kind and ok(ops[step]):
            step += 1
            return True
        return False

    concat = ops[step] if step < len(ops) else None
    concat_dim = concat.dim if takes("Concatenate") else None
    transpose_ok = takes("Transpose", lambda op: op.check_dims)
    # Inkling 2's unembedding (transformers 5.24) keeps the first `unpadded_vocab_size` rows: a no-op, checked by the
    # caller, when the checkpoint stores exactly the model's rows (as save_pretrained of the model writes them)
    unpad = takes("Inkling2UnpadVocab")
    if step != len(ops):
        _refuse_op(name, ops[step], converter, model_type)
        raise ArchitectureError(
            f"{model_type}: {name} is built with {[type(o).__name__ for o in ops]}; reshard composes only "
            "MergeModulelist, Concatenate and shape-checked Transpose so far. This model type is not supported yet."
        )
    return concat_dim, transpose_ok, unpad


def _refuse_op(name, op, converter, model_type) -> None:
    """Refuse, with the reason, the ops whose refusal says more than their name (new in transformers 5.24, 5.25)."""
    kind = type(op).__name__
    if kind == "Split":  # Sarvam-MoE's fused `query_key_value`, Lara-Mini's fused `linear_attn.in_proj`
        raise ArchitectureError(
            f"{model_type}: {name} is one part of an on-disk tensor that transformers splits (Split of "
            f"{list(converter.source_patterns)} into {list(converter.target_patterns)}); reshard builds each tensor "
            "from whole on-disk tensors, so a checkpoint storing them fused is not supported yet (one saved with "
            "the in-memory names, save_pretrained(save_original_format=False), is). Nothing was written.")
    if kind == "Transpose" and not op.check_dims:  # Ergo's router (`gate_kernel`) and shared expert, [in, out] on disk
        raise ArchitectureError(
            f"{model_type}: {name} is stored transposed (transformers transposes on-disk "
            f"{', '.join(p.replace(chr(92), '') for p in converter.source_patterns)} as it loads); reshard copies "
            "whole on-disk tensors byte for byte and does not transpose, so a checkpoint "
            "storing them transposed is not supported yet (one saved with the in-memory names, "
            "save_pretrained(save_original_format=False), is). Nothing was written.")
    if kind == "Inkling2LoopDequantizeExperts":
        raise ArchitectureError(
            f"{model_type}: {name} is built with {[type(o).__name__ for o in converter.operations]} (transformers "
            "dequantizes the NVFP4/MXFP8 experts of the original checkpoints as it loads them); reshard does not "
            "compose them yet, so this model type is not supported yet. Nothing was written.")


def _ambiguous(name, keys):
    raise ArchitectureError(f"{name}: several on-disk keys map to it without a merge op: {keys[:4]}.")


def _check_cover(name, shape, pieces, index) -> None:
    """Pieces must lie inside the target and add up to it exactly (they are disjoint by construction)."""
    total = 0
    for p in pieces:
        entry = index.tensors[p.source]
        extent = list(entry.shape)
        if p.stacked_dim is not None:
            extent.insert(p.stacked_dim, 1)
        if len(extent) != len(shape) or any(o + e > s for o, e, s in zip(p.offset, extent, shape)):
            raise CheckpointError(f"{name}: on-disk {p.source} {list(entry.shape)} does not fit the model's shape "
                                  f"{list(shape)}; the checkpoint does not match config.json.", path=entry.file)
        total += math.prod(extent)
    if total != math.prod(shape):
        raise CheckpointError(f"{name}: the checkpoint holds {total} of its {math.prod(shape)} elements (shape "
                              f"{list(shape)}); expert keys are missing.", path=index.source)
