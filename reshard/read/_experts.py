"""Find the experts: map on-disk keys to the model's in-memory tensors with transformers' own conversion mapping.

transformers owns the knowledge of how each model type stores its weights (`conversion_mapping.py`) and which
modules are expert-parallel (the model's `ep_plan`). We build the model on the meta device (no memory, no data),
replay the key renaming transformers applies at load time, and turn each converter's ops into `Piece` offsets
(`reshard.read._converter_ops`: only the ops we can compose slice by slice are accepted, any other is refused by name).
Keys that differ only in their layer and expert numbers are renamed by transformers once per such template
(`reshard.read._key_templates`), so transformers' share of the work does not grow with the number of layers.
"""

from __future__ import annotations

import gc
import sys
from collections import defaultdict
from contextlib import contextmanager

from ._checkpoint import CheckpointIndex
from ._config_bounds import check_config_bounds
from ._converter_ops import compose_pieces
from ._key_templates import indices_are_opaque, natural_sort, rename_by_template
from ..errors import ArchitectureError, CheckpointError
from ..plan import ModelLayout, TargetTensor, is_router, role_of, whole_tensor


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
        # nested too: Ergo's per-expert norm (`experts.post_expert_norm.weight`, [E, hidden]) is sharded with them
        return {f"{m}.{p}" for m in modules for p, _ in model.get_submodule(m).named_parameters()}, True
    names = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts":
            names.update(f"{name}.{p}" for p, t in module.named_parameters()
                         if t.ndim >= 2 and not is_router(p))  # a router nested in `experts` stays dense
    return names, False


def find_experts(index: CheckpointIndex) -> ModelLayout:
    """Map every on-disk tensor of `index` to the model's state dict, marking the routed experts.

    The result is cached by config, tensor names/dtypes/shapes and versions (`reshard.read._cache`).

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
    if index.config.get("quantization_config"):  # callers plan the bf16 view (`open_source`)
        raise ArchitectureError(f"{index.source}: a quantized checkpoint is mapped through its bf16 view; open it with "
                                "reshard.open_source(...), whose model_layout() is the bf16 view's.")
    # before the cache too: a config the headers cannot hold is refused the same way, cached layout or not
    check_config_bounds(index.config, ((t.name, t.shape) for t in index.tensors.values()), where=index.source)
    from ._cache import load_layout, save_layout

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
    template by transformers and the rest by substituting the indices (`reshard.read._key_templates`); False renames
    every key with transformers, the reference the fast path is tested against (tests/test_layout_fast.py).
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
        pieces = compose_pieces(name, tuple(meta.shape), groups, by_pattern, index, index.config["model_type"])
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

    fast = by_template and indices_are_opaque(mapping, prefix, meta_state)
    if fast:
        renamed, indices = rename_by_template(index.tensors, transformers_rename, rename, meta_state)
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
                natural_sort(keys, indices, dot_natural_key)
        ignored.sort(key=dot_natural_key)
    return collected, ignored


def ignore_patterns(model) -> tuple[str, ...]:
    """The model's `_keys_to_ignore_on_load_unexpected` as strings (transformers allows None, a list or a set)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    if not isinstance(patterns, (list, tuple, set, frozenset)):
        return ()
    return tuple(sorted(str(p) for p in patterns))
