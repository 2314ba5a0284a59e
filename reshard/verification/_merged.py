"""`reshard verify` of a merged (plain Hugging Face) folder, what `reshard merge` writes: the index agrees with the
headers, and every tensor equals the source's through each side's own key mapping."""

from __future__ import annotations

import json
from dataclasses import replace

from ..errors import ReshardError, UsageError
from ..manifest import tied_from_record
from ..plan import DTYPE_BITS, MergeLayout
from ..read import INDEX_NAME, SourceKind, open_source
from ..results import Checked, VerifyResult
from ..runs import chunk_runs
from ..write import MergeIndex
from ._common import COMPARE_BLOCK, reworded


def check_merged(folder, *, against=None, progress: bool | None = None) -> VerifyResult:
    """`check_folder` for a plain HF checkpoint (what `reshard merge` writes): the index agrees with the headers and
    its `metadata.total_size`; with `against` (the original HF checkpoint, a reshard folder or a saved distributed
    checkpoint), the key set is the source's on-disk one (`--layout original`) or its in-memory names (`fused`): the
    one the index records, when `reshard merge` wrote it (`MergeIndex.layout`), and every in-memory tensor, read
    through each side's own key mapping, equals the source's byte for byte."""
    result = VerifyResult(False, folder.location.spec, None if against is None else against.spec, 0, 0, 0, 0,
                          kind=Checked.MERGED)
    try:
        dest = reworded(folder.as_source).index  # its headers, through the store it was opened with
    except ReshardError as e:
        return replace(result, problems=(str(e),))
    problems: list[str] = []
    index = _merge_index(dest.store)
    if isinstance(index, str):
        problems.append(index)
    elif index is not None and index.total_size != dest.total_bytes:
        problems.append(f"{INDEX_NAME}: metadata.total_size is {index.total_size}, the tensors hold "
                        f"{dest.total_bytes} bytes")
    compared = 0
    if against is not None and not problems:
        compared = _compare_merged(dest, against, index, progress, problems)
    return replace(result, ok=not problems, files=len(dest.files), tensors=len(dest.tensors),
                 bytes_compared=compared, problems=tuple(problems))


def _merge_index(store) -> MergeIndex | str | None:
    """A merged folder's index (`MergeIndex`; None without one; a problem as a string)."""
    if INDEX_NAME not in store.names():
        return None
    try:
        return MergeIndex.from_document(json.loads(store.read_all(INDEX_NAME, 64 << 20, "safetensors index")))
    except ReshardError as e:  # names the index and what is wrong in it
        return str(e)
    except (OSError, ValueError, RecursionError) as e:
        return f"{INDEX_NAME}: unreadable ({type(e).__name__}: {e})"


def _source_view(source):
    """(index, layout, the on-disk keys of the source layout, the in-memory names a fused copy holds)."""
    index, layout = source.index, source.model_layout()
    if source.kind is not SourceKind.CHECKPOINT:
        original = None if index.original is None else {p[0] for pieces in index.original.values() for p in pieces}
        tied = set(index.tied)
    else:
        if source.quantization is not None:
            raise UsageError(f"{source.spec} is a quantized checkpoint: a merged folder holds the bf16 values computed "
                             "from it, not its bytes. Verify the merged folder against the reshard folder it was "
                             "merged from, and that folder with `reshard verify OUT --against SRC`, which "
                             "recomputes every dequantized chunk.")
        original = {p.source for t in layout.tensors for p in t.pieces}
        tied = set(tied_from_record({t.name: [(p.source,) for p in t.pieces] for t in layout.tensors}))
    extras = {t.name for t in layout.extras}  # written back under their own keys in either layout
    return (index, layout, None if original is None else original | extras,
            ({t.name for t in layout.tensors} - tied) | extras)


def _compare_merged(dest, against, index: MergeIndex | None, progress, problems) -> int:
    from tqdm.auto import tqdm

    from ..read import find_experts

    extras_from = None if index is None else index.extras_from
    src_index, src_layout, original_keys, fused_keys = _source_view(against)
    sources = [(t, src_index) for t in (*src_layout.tensors, *src_layout.extras)]
    if extras_from is not None and not src_layout.extras:  # a trained folder merged with `--extras-from`
        # the one source verify opens itself: only the checked folder's index names it
        extras_index, extras_layout, _, _ = _source_view(reworded(lambda: open_source(extras_from)))
        names = {t.name for t in extras_layout.extras}
        original_keys = None if original_keys is None else original_keys | names
        fused_keys |= names
        sources += [(t, extras_index) for t in extras_layout.extras]
    if (problem := _keys_problem(set(dest.tensors), original_keys, fused_keys, index)) is not None:
        problems.append(problem)
        return 0
    try:
        found = find_experts(dest)
    except ReshardError as e:
        problems.append(f"{dest.source}: {e}")
        return 0
    dest_layout = {**found.by_name(), **{t.name: t for t in found.extras}}
    total = sum(t.numel * DTYPE_BITS[t.dtype] // 8 for t, _ in sources)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard verify",
               disable=None if progress is None else not progress)
    compared = 0
    try:
        for src, src_index in sources:
            mine = dest_layout.get(src.name)
            if mine is None or mine.shape != src.shape or mine.dtype != src.dtype:
                problems.append(f"{src.name}: {'missing' if mine is None else f'{mine.dtype} {list(mine.shape)}'}, "
                                f"the source has {src.dtype} {list(src.shape)}")
                continue
            box = tuple((0, n) for n in src.shape)
            n = _compare_runs(chunk_runs(src, box, src_index.tensors), chunk_runs(mine, box, dest.tensors),
                              src_index.store, dest.store, bar)
            if n is None:
                problems.append(f"{src.name}: differs from the source")
            else:
                compared += n
    finally:
        bar.close()
    return compared


def _keys_problem(keys: set[str], original_keys: set[str] | None, fused_keys: set[str],
                  index: MergeIndex | None) -> str | None:
    """Why the merged folder's `keys` are not the source's in the layout its index records (either layout when it
    records none), or None."""
    recorded = None if index is None else index.layout
    if recorded is None:
        if keys in (original_keys, fused_keys):
            return None
        expected = original_keys if original_keys is not None else fused_keys
        return (f"the keys are neither the source's on-disk ones nor its in-memory names: missing "
                f"{sorted(expected - keys)[:3]}, extra {sorted(keys - expected)[:3]}")
    original = recorded is MergeLayout.ORIGINAL
    expected, other = (original_keys, fused_keys) if original else (fused_keys, original_keys)
    if keys == expected:
        return None
    held = f" (they are the {'fused' if original else 'original'} layout's)" if keys == other else ""
    if expected is None:
        return (f"{INDEX_NAME} records the {recorded.value} layout, but the source's on-disk layout is unknown, so "
                f"the keys cannot be checked against it{held}")
    return (f"{INDEX_NAME} records the {recorded.value} layout, but the keys are not the source's "
            f"{'on-disk ones' if original else 'in-memory names'}{held}: missing {sorted(expected - keys)[:3]}, "
            f"extra {sorted(keys - expected)[:3]}")


def _compare_runs(a, b, store_a, store_b, bar) -> int | None:
    """Compare two run lists tiling the same bytes (each sorted by `dst`) block by block; bytes compared, or None at
    the first difference."""
    i = j = position = 0
    while i < len(a) and j < len(b):
        ra, rb = a[i], b[j]
        end = min(ra.dst + ra.nbytes, rb.dst + rb.nbytes, position + COMPARE_BLOCK)
        n = end - position
        if store_a.read(ra.file, ra.src + position - ra.dst, n) != store_b.read(rb.file, rb.src + position - rb.dst, n):
            return None
        bar.update(n)
        position = end
        if position == ra.dst + ra.nbytes:
            i += 1
        if position == rb.dst + rb.nbytes:
            j += 1
    return position
