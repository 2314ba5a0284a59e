"""Find the experts: map on-disk keys to the model's in-memory tensors with transformers' own conversion mapping.

transformers owns the knowledge of how each model type stores its weights (`conversion_mapping.py`) and which
modules are expert-parallel (the model's `ep_plan`). We build the model on the meta device (no memory, no data),
replay the key renaming transformers applies at load time, and turn each converter's ops into `Piece` offsets.
Only the ops we can compose slice by slice are accepted; anything else is refused by name. Keys that differ only in
their layer and expert numbers are renamed by transformers once per such template (`_rename_by_template`), so
transformers' share of the work does not grow with the number of layers.
"""

from __future__ import annotations

import gc
import math
import re
import sys
from collections import defaultdict
from contextlib import contextmanager

from .checkpoint import CheckpointIndex
from ..errors import ArchitectureError, CheckpointError
from ..plan.layout import ModelLayout, Piece, TargetTensor, is_router, role_of, whole_tensor

# A whole dotted component made of digits (a layer or expert index); `split` keeps it as an odd-numbered part.
_INDEX = re.compile(r"(?<![^.])(\d+)(?![^.])")
# Regex constructs that could tell one index from another (a digit class, a length, a literal number): a mapping
# using one is renamed key by key.
_INDEX_SPECIFIC = re.compile(r"\\[dDwW]|\[|\{|(?<![A-Za-z0-9_\\])\d")


def build_meta_model(config: dict):
    """Build the model class named by `config` on the meta device (no weights are allocated)."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ArchitectureError(
            f"model_type {model_type!r} is not known to transformers {transformers.__version__}. "
            "reshard maps keys with transformers' own tables; upgrade transformers or check config.json."
        )
    config_class = CONFIG_MAPPING[model_type]
    # config.json stores inf/nan as {"__float__": "Infinity"}; transformers decodes that when it reads the file
    decode = getattr(config_class, "_decode_special_floats", None)
    try:
        hf_config = config_class.from_dict(decode(dict(config)) if decode else dict(config))
    except Exception as e:  # noqa: BLE001  transformers' strict fields raise their own types (a str for an int, ...)
        reason = " ".join(str(e).split())[:300]
        raise CheckpointError(f"config.json: transformers refuses it for {model_type} ({type(e).__name__}: {reason}). "
                              "Fix that value in config.json (a number where a number belongs, finite, of the right "
                              "type). Nothing was read or changed.", path="config.json") from e
    candidates = [getattr(transformers, name, None) for name in config.get("architectures") or []]
    candidates = [c for c in candidates if c is not None] + [transformers.AutoModelForCausalLM]
    errors = []
    for model_class in candidates:
        try:
            with torch.device("meta"):
                if hasattr(model_class, "from_config"):
                    return model_class.from_config(hf_config)
                return model_class(hf_config)
        except Exception as e:  # a model's __init__ can raise anything on a bad config (AssertionError too)
            errors.append(f"{getattr(model_class, '__name__', model_class)}: {e}")
    raise ArchitectureError(f"model_type {model_type!r}: could not build the model on the meta device "
                            f"({'; '.join(errors)}).")


def expert_param_names(model) -> tuple[set[str], bool]:
    """The routed-expert parameters, and whether transformers can expert-parallelize them.

    The parameters of the modules the model's EP plan dispatches to experts (`ep_dispatch_experts`). A model with
    no such plan (Llama 4, DBRX, JetMoE in transformers 5.23) still has FSDP chunk its stacked experts on dim 0,
    so the parameters under its `experts` modules count as experts for planning, with ep = 1 only.
    """
    plan = model._expand_parallel_plan(dict(getattr(model, "ep_plan", None) or {}))
    modules = {name for name, style in plan.items() if style == "ep_dispatch_experts"}
    if modules:
        return {f"{m}.{p}" for m in modules for p, _ in model.get_submodule(m).named_parameters(recurse=False)}, True
    names = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts":
            names.update(f"{name}.{p}" for p, t in module.named_parameters()
                         if t.ndim >= 2 and not is_router(p))  # a router nested in `experts` stays dense
    return names, False


def find_experts(index: CheckpointIndex) -> ModelLayout:
    """Map every on-disk tensor of `index` to the model's state dict, marking the routed experts.

    The result is cached by config, tensor names/dtypes/shapes and versions (`reshard.read.cache`).

    Args:
        index: the checkpoint's metadata (`read_checkpoint`).

    Returns:
        A `ModelLayout`: every state-dict tensor with its role and the on-disk pieces that fill it.

    Raises:
        ArchitectureError: the model type is unknown, or its conversion uses an op reshard cannot compose.
        CheckpointError: a state-dict tensor has no source, or the pieces do not fit it.
    """
    if not index.config.get("model_type"):
        raise ArchitectureError(f"{index.source}: config.json has no model_type (or is missing); reshard needs it to "
                                "know the architecture.")
    if index.config.get("quantization_config"):  # callers plan the bf16 view (`reshard.api.read_source`)
        raise ArchitectureError(f"{index.source}: a quantized checkpoint is mapped through its bf16 view; read it with "
                                "reshard.api.read_source (or reshard.read.quant.dequantized_view).")
    from .cache import load_layout, save_layout

    cached = load_layout(index)
    if cached is not None:
        return cached
    with _gc_paused(freeze="torch" not in sys.modules):
        layout = layout_from_model(build_meta_model(index.config), index)
    save_layout(index, layout)
    return layout


@contextmanager
def _gc_paused(freeze: bool):
    """Pause the cyclic garbage collector around a cache miss; with `freeze`, exempt what it made from later passes.

    Importing torch and transformers allocates about two million objects (modules, classes, functions) that live as
    long as the process, and the collector walks all of them again on every full pass: during the imports, after
    them, and once more at exit, a third of a cold `plan`. `freeze` (`gc.freeze`) is only asked for when this call
    did the import, so what it pins is that, plus whatever the process held before (little, in a process that had
    not imported torch yet); the meta model and the layout hold no reference cycles and are freed as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def layout_from_model(model, index: CheckpointIndex, *, by_template: bool = True) -> ModelLayout:
    """The `find_experts` work once the meta model exists (split out so callers can reuse a model).

    With `by_template` (the default), keys that differ only in their layer and expert indices are renamed once per
    template by transformers and the rest by substituting the indices (`_rename_by_template`); False renames every
    key with transformers, the reference the fast path is tested against (tests/test_layout_fast.py).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    meta_state = model.state_dict()
    mapping = get_model_conversion_mapping(model, None, None)
    by_pattern = {p: c for c in mapping if isinstance(c, WeightConverter) for p in c.source_patterns}
    collected, ignored = _collect(model, index, mapping, meta_state, by_template)
    experts, expert_parallel = expert_param_names(model)
    buffers = {name for name, _ in model.named_buffers()}
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    tensors = []
    for name, meta in meta_state.items():
        groups = collected.get(name)
        if groups is None and tied.get(name) in collected:
            groups = collected[tied[name]]  # a tied weight the checkpoint stores once
        if groups is None:
            raise CheckpointError(f"{index.source}: the model's tensor {name!r} has no source in the checkpoint "
                                  f"({index.config['model_type']}); the checkpoint is incomplete or for another "
                                  "model.", path=index.source)
        pieces = _compose(name, tuple(meta.shape), groups, by_pattern, index, index.config["model_type"])
        dtypes = {index.tensors[p.source].dtype for p in pieces}
        if len(dtypes) != 1:
            raise CheckpointError(f"{name}: its on-disk pieces have mixed dtypes {sorted(dtypes)}.", path=index.source)
        tensors.append(TargetTensor(name, tuple(meta.shape), dtypes.pop(), role_of(name, name in experts),
                                    name not in buffers, tuple(pieces)))
    extras = tuple(whole_tensor(key, index.tensors[key].shape, index.tensors[key].dtype) for key in ignored)
    return ModelLayout(index.config["model_type"], type(model).__name__, tuple(tensors), tuple(ignored),
                       expert_parallel, extras, ignore_patterns(model))


def _collect(model, index: CheckpointIndex, mapping, meta_state, by_template: bool):
    """Every on-disk key renamed as transformers' loader renames it: (target -> source pattern -> keys in the order
    transformers collects them, natural key order; the keys that map to no tensor of the model)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix

    def transformers_rename(key: str) -> tuple[str, str | None]:  # what transformers' loader does with one key
        return rename_source_key(key, renamings, converters, prefix, meta_state)

    def rename(key: str) -> tuple[str, str | None]:
        target, pattern = transformers_rename(key)
        if target not in meta_state and key in meta_state:  # already an in-memory name
            target, pattern = rename_source_key(key, [], [], prefix, meta_state)
        return target, pattern

    fast = by_template and _indices_are_opaque(mapping, prefix, meta_state)
    if fast:
        renamed, indices = _rename_by_template(index.tensors, transformers_rename, rename, meta_state)
    else:
        renamed = {key: rename(key) for key in sorted(index.tensors, key=dot_natural_key)}
    collected: dict[str, dict[str | None, list[str]]] = defaultdict(lambda: defaultdict(list))
    ignored = []
    for key, (target, pattern) in renamed.items():
        if target in meta_state:
            collected[target][pattern].append(key)
        else:
            ignored.append(key)
    if fast:
        for groups in collected.values():
            for keys in groups.values():
                _natural_sort(keys, indices, dot_natural_key)
        ignored.sort(key=dot_natural_key)
    return collected, ignored


def ignore_patterns(model) -> tuple[str, ...]:
    """The model's `_keys_to_ignore_on_load_unexpected` as strings (transformers allows None, a list or a set)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    if not isinstance(patterns, (list, tuple, set, frozenset)):
        return ()
    return tuple(sorted(str(p) for p in patterns))


def _indices_are_opaque(mapping, prefix: str, meta_state) -> bool:
    """Whether renaming treats index components as opaque text, so a template's rule holds for all its keys.

    Holds when every transform renames with the stock regex machinery (no subclass that computes indices, like
    Inkling 2's offset rename), none of its patterns can tell one index from another (`_INDEX_SPECIFIC`), and the
    base-model prefix fix-up cannot depend on an index. transformers strips `prefix` and the character after it
    when the rest is a state-dict name, else adds `prefix.` when that is one; the outcome can only differ between
    two keys of a template if some state-dict name is also one with the prefix stripped once or twice.
    """
    from transformers.core_model_loading import WeightTransform

    for transform in mapping:
        if type(transform).rename_source_key is not WeightTransform.rename_source_key:
            return False
        if any(_INDEX_SPECIFIC.search(p) for p in (*transform.source_patterns, *transform.target_patterns)):
            return False
        if any(ch.isdigit() for ch in f"{transform.scope_prefix or ''}{transform.base_model_prefix or ''}"):
            return False
    if any(ch.isdigit() for ch in prefix or ""):
        return False

    def strip(name: str) -> str | None:
        return name[len(prefix) + 1:] if prefix and name.startswith(prefix) and len(name) > len(prefix) else None

    for name in meta_state:
        once = strip(name)
        if once is not None and (once in meta_state or strip(once) in meta_state):
            return False
    return True


def _rename_by_template(keys, transformers_rename, rename, meta_state):
    """`rename` of every key (in `keys`' order), calling transformers once or twice per template, not once per key.

    Keys equal but for their index components (`model.layers.{L}.mlp.experts.{E}.gate_proj.weight`) form a template.
    `transformers_rename` is learnt on a member whose indices are pairwise distinct: each index of its target must
    be one of them, which says where each target index comes from. The rule is checked with `transformers_rename` on
    one more member per index position that varies, and used only where its target is a state-dict name; any other
    key goes through `rename`. Only valid when `_indices_are_opaque`.

    Returns:
        key -> (target, pattern), and key -> its template and indices (for `_natural_sort`).
    """
    split = {}
    templates: dict[tuple[str, ...], list[tuple[str, list[str]]]] = defaultdict(list)
    for key in keys:
        parts = _INDEX.split(key)
        split[key] = template, indices = tuple(parts[0::2]), parts[1::2]
        templates[template].append((key, indices))
    rules = {t: _learn_rule(members, transformers_rename) for t, members in templates.items() if len(members) > 1}
    out = {}
    for key, (template, indices) in split.items():
        rule = rules.get(template)
        if rule is not None:
            texts, positions, pattern = rule
            target = _fill(texts, [indices[j] for j in positions])
            if target in meta_state:
                out[key] = (target, pattern)
                continue
        out[key] = rename(key)
    return out, split


def _fill(texts, indices) -> str:
    return "".join(t + i for t, i in zip(texts, indices)) + texts[-1]


def _learn_rule(members, transformers_rename):
    """(target texts, source position of each target index, pattern) for a template, or None when not learnt."""
    first = next(((k, i) for k, i in members if len(set(i)) == len(i)), None)
    if first is None:
        return None
    key, indices = first
    target, pattern = transformers_rename(key)
    parts = _INDEX.split(target)
    try:
        positions = [indices.index(i) for i in parts[1::2]]
    except ValueError:  # an index the renaming made up or changed
        return None
    texts = parts[0::2]
    for position in range(len(indices)):
        other = next(((k, i) for k, i in members if i[position] != indices[position]), None)
        if other is not None and \
                transformers_rename(other[0]) != (_fill(texts, [other[1][j] for j in positions]), pattern):
            return None
    return texts, positions, pattern


def _natural_sort(keys: list[str], split, dot_natural_key) -> None:
    """Sort `keys` into transformers' natural key order. Keys of one template differ only in their indices, which
    that order compares as integers, left to right."""
    if len({split[k][0] for k in keys}) > 1:
        keys.sort(key=dot_natural_key)
    else:
        keys.sort(key=lambda k: [int(i) for i in split[k][1]])


def _compose(name, shape, groups, by_pattern, index, model_type) -> list[Piece]:
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
    """Refuse, with the reason, the ops whose refusal says more than their name (each new in transformers 5.24)."""
    kind = type(op).__name__
    if kind == "Split":  # Sarvam-MoE's fused `query_key_value`, Lara-Mini's fused `linear_attn.in_proj`
        raise ArchitectureError(
            f"{model_type}: {name} is one part of an on-disk tensor that transformers splits (Split of "
            f"{list(converter.source_patterns)} into {list(converter.target_patterns)}); reshard builds each tensor "
            "from whole on-disk tensors, so a checkpoint storing them fused is not supported yet (one saved with "
            "the in-memory names, save_pretrained(save_original_format=False), is). Nothing was written.")
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
