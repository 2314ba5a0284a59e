"""The fast layout (transformers renames one key per template) equals the full one (it renames every key).

`layout_from_model` groups the on-disk keys that differ only in their index components (layer and expert numbers),
renames one or two of each group with transformers' `rename_source_key` and fills in the indices of the others;
`by_template=False` renames every key, as before. For every model type of the breadth matrix, in both on-disk
layouts, on a config with more layers than layer kinds (dense and MoE layers interleaved where the type has both),
the two must give the same `ModelLayout`, and the fast one must rename fewer keys, except for the types in
`KEY_BY_KEY`, whose mapping computes indices and which are therefore renamed key by key.
"""

from __future__ import annotations

import random
import re

import pytest

import breadth

LAYERS = 7  # more than any type's number of layer kinds; odd, so alternating patterns do not line up with it

# Dense/MoE interleavings closer to real checkpoints than the repeated tiny patterns give
LONGER: dict[str, dict] = {
    "glm4_moe": dict(first_k_dense_replace=3, n_routed_experts=12),  # as GLM-4.6; two-digit experts sort apart
    "deepseek_v3": dict(first_k_dense_replace=2),
    "qwen2_moe": dict(mlp_only_layers=[0, 4], decoder_sparse_step=1),
    "qwen3_moe": dict(mlp_only_layers=[2, 5]),
    "qwen3_next": dict(mlp_only_layers=[3]),
    "ernie4_5_moe": dict(moe_layer_end_index=LAYERS - 1),
    "cohere2_moe": dict(mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse", "sparse"]),
    "mellum": dict(mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense", "sparse", "sparse"]),
    "llama4_text": dict(interleave_moe_layer_step=3),
    "longcat_flash": dict(num_layers=3),
    "kolibri1_1": dict(kv_source_layers=list(range(LAYERS))),  # transformers 5.25: each layer its own K/V
}

# Model types whose conversion mapping is not index-agnostic, with the reason
KEY_BY_KEY = {"inkling2_text": "Inkling2IndexOffsetWeightRename computes a layer index from another one",
              "inkling2_loop_text": "Inkling 2's mapping (transformers 5.24), with its index-computing rename"}

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32",
                      "bool": "BOOL", "uint8": "U8", "int8": "I8"}


def long_config(model_type: str):
    """`breadth.tiny_config` with LAYERS layers: per-layer lists repeat their tiny pattern, plus `LONGER`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fields = {**breadth.BASE, **breadth.TINY.get(model_type, {})}
    depth = config_class.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    tiny = fields.pop("num_hidden_layers") if depth != "num_hidden_layers" else fields["num_hidden_layers"]
    tiny = fields.get(depth, tiny)
    fields = {k: [v[i % tiny] for i in range(LAYERS)] if isinstance(v, list) and len(v) == tiny else v
              for k, v in fields.items()}
    fields[depth] = LAYERS
    return config_class(**{**fields, **LONGER.get(model_type, {})})


def meta_model(model_type: str):
    import torch

    breadth._quiet()
    with torch.device("meta"):
        return breadth.causal_class(model_type)(long_config(model_type))


def index_of(state: dict, model_type: str, seed: int = 0):
    """A `CheckpointIndex` holding `state`'s names, dtypes and shapes, in a shuffled order."""
    from reshard.read import CheckpointIndex
    from reshard.read import TensorEntry

    items = list(state.items())
    random.Random(seed).shuffle(items)
    tensors = {name: TensorEntry(name, "model.safetensors", SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")],
                                 tuple(t.shape), 0) for name, t in items}
    return CheckpointIndex("<memory>", None, None, {"model_type": model_type}, (), tensors)


def on_disk(model, layout: str) -> dict:
    """What `save_pretrained` would write, on the meta device: `original` reverts transformers' load conversions."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return revert_weight_conversion(model, dict(state)) if layout == "original" else state


def both_layouts(model, index, monkeypatch):
    """Per path (every key, by template): the layout (or the refusal), the keys transformers renamed, and those it
    renamed a second time as in-memory names (the full path's fallback, key by key in both)."""
    import transformers.core_model_loading as loading

    from reshard.errors import ReshardError
    from reshard.read._experts import layout_from_model
    from reshard.plan import layout_to_dict

    calls = []
    rename = loading.rename_source_key

    def counting(key, renamings, *args, **kwargs):
        calls.append((key, bool(renamings)))
        return rename(key, renamings, *args, **kwargs)

    monkeypatch.setattr(loading, "rename_source_key", counting)
    out = []
    for by_template in (False, True):
        calls.clear()
        try:
            result = layout_to_dict(layout_from_model(model, index, by_template=by_template))
        except ReshardError as e:
            result = f"{type(e).__name__}: {e}"
        out.append((result, {k for k, _ in calls}, {k for k, first in calls if not first}))
    return out


def _types():
    return [c.model_type for c in breadth.runnable()]


@pytest.mark.parametrize("layout", breadth.LAYOUTS)
@pytest.mark.parametrize("model_type", _types())
def test_fast_layout_equals_full_layout(model_type, layout, monkeypatch):
    from reshard.read._key_templates import indices_are_opaque
    from transformers.conversion_mapping import get_model_conversion_mapping

    model = meta_model(model_type)
    layers = {int(m.group(1)) for name in model.state_dict() if (m := re.search(r"\.(\d+)\.", name))}
    assert len(layers) >= 3, f"{model_type}: only {len(layers)} numbered layers; the config did not grow"
    index = index_of(on_disk(model, layout), model_type)
    (full, full_renamed, again), (fast, fast_renamed, _) = both_layouts(model, index, monkeypatch)
    assert fast == full
    opaque = indices_are_opaque(get_model_conversion_mapping(model, None, None), model.base_model_prefix,
                                model.state_dict())
    assert opaque == (model_type not in KEY_BY_KEY)
    assert full_renamed == set(index.tensors)
    if opaque:  # the shortcut applied: per template, one key to learn the rule and one per index to check it
        assert len(fast_renamed - again) <= learning_bound(index.tensors) < len(full_renamed)
    else:
        assert fast_renamed == full_renamed


def learning_bound(keys) -> int:
    templates: dict[tuple[str, ...], int] = {}
    for key in keys:
        parts = re.split(r"(?<![^.])(\d+)(?![^.])", key)
        templates[tuple(parts[0::2])] = templates.get(tuple(parts[0::2]), 0) + 1
    return sum(min(members, len(template)) for template, members in templates.items())  # len = indices + 1


def test_key_by_key_types_are_discovered():
    assert set(KEY_BY_KEY) & breadth.known_model_types() <= set(_types())  # the installed transformers' types


def _glm_index():
    """A GLM-4.6-shaped checkpoint (3 dense layers, then MoE) with per-expert keys in alphabetical order, as
    safetensors headers list them (`experts.10` before `experts.2`), and the MTP layer transformers ignores."""
    model = meta_model("glm4_moe")
    state = on_disk(model, "original")
    last = max(int(m.group(1)) for name in state if (m := re.search(r"^model\.layers\.(\d+)\.", name)))
    mtp = {name.replace(f"layers.{last}.", f"layers.{last + 1}.", 1): t for name, t in state.items()
           if name.startswith(f"model.layers.{last}.")}
    norm = state["model.norm.weight"]
    mtp.update({f"model.layers.{last + 1}.{n}": norm for n in ("enorm.weight", "hnorm.weight",
                                                                "shared_head.norm.weight")})
    state = {**state, **mtp}
    index = index_of(dict(sorted(state.items())), "glm4_moe")
    return model, index, last


def test_glm_shaped_checkpoint_with_mtp_layer(monkeypatch):
    model, index, last = _glm_index()
    (full, _, _), (fast, fast_renamed, _) = both_layouts(model, index, monkeypatch)
    assert fast == full
    ignored = set(fast["ignored_sources"])
    assert ignored == {k for k in index.tensors if k.startswith(f"model.layers.{last + 1}.")}
    assert len(fast_renamed - ignored) <= learning_bound(index.tensors)
    by_name = {t[0]: t for t in fast["tensors"]}
    pieces = by_name[f"model.layers.{last}.mlp.experts.down_proj"][5]
    assert [p[0] for p in pieces] == [f"model.layers.{last}.mlp.experts.{e}.down_proj.weight" for e in range(12)]


# ---- the rule learning itself, on renamings that do depend on the indices ---------------------------------------

KEYS = [f"blocks.{layer}.experts.{e}.w" for layer in range(5) for e in range(4)] + ["embed.weight"]


def _by_template(rename):
    """`rename_by_template` over KEYS, and how many times it called `rename`."""
    from reshard.read._key_templates import rename_by_template

    meta_state = {rename(k)[0] for k in KEYS}
    calls = []

    def counted(key):
        calls.append(key)
        return rename(key)

    out, _ = rename_by_template(KEYS, counted, counted, meta_state)
    return out, len(calls)


@pytest.mark.parametrize("rename", [
    pytest.param(lambda k: (re.sub(r"blocks\.(\d+)", lambda m: f"layers.{int(m.group(1)) + 1}", k), None),
                 id="layer-offset"),
    pytest.param(lambda k: (k.replace("blocks.", "blocks_"), "p"), id="index-glued-to-text"),
])
def test_rules_that_do_not_hold_fall_back_to_every_key(rename):
    out, calls = _by_template(rename)
    assert out == {k: rename(k) for k in KEYS}
    assert calls >= len(KEYS) - 1


@pytest.mark.parametrize("rename", [
    pytest.param(lambda k: (re.sub(r"^blocks\.(\d+)\.experts\.\d+\.w$", r"layers.\1.experts.w", k), "p"),
                 id="merged"),
    pytest.param(lambda k: (re.sub(r"^blocks\.(\d+)\.experts\.(\d+)\.w$", r"layers.\2.experts.\1.w", k), None),
                 id="indices-swapped"),
    pytest.param(lambda k: (re.sub(r"experts\.(\d+)", r"experts.\1.\1", k), None), id="index-repeated"),
])
def test_index_agnostic_renaming_is_learnt_from_few_keys(rename):
    out, calls = _by_template(rename)
    assert out == {k: rename(k) for k in KEYS}
    assert calls == 3 + 1  # learnt on one key, checked on one per index position; `embed.weight` alone


@pytest.mark.parametrize("pattern, opaque", [
    (r"mlp\.experts\.w13_weight", True), ("fc1", True), (r"^model\.(?:(?!language_model\.))(.+)", True),
    (r"layers\.(\d+)", False), ("layers.0.mlp", False), (r"experts\.[0-9]+", False), (r"x\.\w{2}", False),
])
def test_index_specific_patterns_are_recognised(pattern, opaque):
    from transformers.core_model_loading import WeightRenaming

    from reshard.read._key_templates import indices_are_opaque

    assert indices_are_opaque([WeightRenaming(pattern, "y")], "model", {}) is opaque


def test_a_prefix_ambiguous_state_dict_is_renamed_key_by_key():
    from reshard.read._key_templates import indices_are_opaque

    assert indices_are_opaque([], "model", {"model.layers.0.w": 0, "layers.1.w": 0, "model": 0})
    assert not indices_are_opaque([], "model", {"model.layers.0.w": 0, "layers.0.w": 0})
    assert not indices_are_opaque([], "model", {"model.model.layers.0.w": 0, "layers.0.w": 0})
    assert not indices_are_opaque([], "model", {"model_layers.0.w": 0, "layers.0.w": 0})  # `^model.` is a regex


# ---- the garbage collector around a cache miss --------------------------------------------------------------------

def test_a_cache_miss_leaves_the_collector_as_it_found_it(tiny, monkeypatch):
    """With torch already imported (as here) nothing is frozen, and the collector ends as it was, on or off."""
    import gc

    from reshard.read._source import read_checkpoint
    from reshard.read import find_experts

    monkeypatch.setenv("RESHARD_CACHE_DIR", "")
    index = read_checkpoint(tiny("glm4_moe"))
    frozen = gc.get_freeze_count()
    find_experts(index)
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()
    try:
        find_experts(index)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_first_import_is_frozen(tiny):
    """In a process that had not imported torch, what the import created is exempted from later collections."""
    import os
    import subprocess
    import sys

    code = ("import gc, sys; from reshard.read._source import read_checkpoint; from reshard.read._experts import find_experts; "
            "assert 'torch' not in sys.modules; find_experts(read_checkpoint(sys.argv[1])); "
            "print(gc.isenabled(), gc.get_freeze_count() > 100_000)")
    result = subprocess.run([sys.executable, "-c", code, str(tiny("glm4_moe"))], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "RESHARD_CACHE_DIR": "", "OMP_NUM_THREADS": "1"})
    assert result.stdout.split() == ["True", "True"], result.stderr[-2000:]
