"""Breadth: every MoE model type of transformers 5.23 that builds tiny, in both on-disk layouts, through reshard.

Per (model type, layout), from `breadth.check_case`: `plan_checkpoint` finds exactly the EP plan's expert parameters;
`write_checkpoint` at a mesh where stock transformers leaves expert ranks empty (balanced and stock layouts) and at
an even one; `verify(out, against=src)`; a single-process `reshard.from_pretrained(out)` equals transformers' own
load of the source, tensor by tensor. Model types reshard refuses are listed in `UNSUPPORTED` with the exact reason.
README.md's support table must be the one these results give (`scripts/support_table.py` prints it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import breadth

CANDIDATES = breadth.discover()

# (model type, layout) -> the exact reason reshard gives; layout None: every layout
UNSUPPORTED: dict[tuple[str, str | None], str] = {
    ("doge", None): f"{breadth.NO_EP_PLAN}; write: <src>: no routed experts found (not a MoE checkpoint); nothing to "
                    "reshard.",
    ("inkling2_text", "original"): "inkling2_text: model.layers.0.mlp.experts.gate_up_proj is built with "
                                   "['Interleave']; reshard composes only MergeModulelist, Concatenate and "
                                   "shape-checked Transpose so far. This model type is not supported yet.",
}


def expected_reason(model_type: str, layout: str) -> str | None:
    return UNSUPPORTED.get((model_type, layout), UNSUPPORTED.get((model_type, None)))


def _cases():
    # Candidates that are not causal-LM MoE models (each with its reason, checked in
    # test_discovery_finds_the_known_families_and_every_tiny_entry and listed in the README table) are not cases.
    for cand in CANDIDATES:
        if cand.skip is not None:
            continue
        if cand.missing_tiny:
            yield pytest.param(cand.model_type, None, id=f"{cand.model_type}-no-tiny-config")
        else:
            for layout in breadth.LAYOUTS:
                yield pytest.param(cand.model_type, layout, id=f"{cand.model_type}-{layout}")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return breadth.Matrix(tmp_path_factory.mktemp("breadth"))


@pytest.mark.parametrize("model_type, layout", list(_cases()))
def test_model_type_plans_writes_verifies_and_loads(matrix, model_type, layout):
    if layout is None:
        pytest.fail(f"{model_type} is a MoE model type of transformers but tests/breadth.py TINY has no tiny config "
                    "for it: add one (see ARCHITECTURES.md 6.9).")
    result = matrix.result(model_type, layout)
    if result is None:  # save_pretrained writes the same keys either way: the fused checkpoint is the original one
        result = matrix.result(model_type, "original")
    expected = expected_reason(model_type, layout)
    if result.status == "fail":
        pytest.fail(f"{model_type} ({layout}): {result.reason}\n{result.steps[-1] if result.steps else ''}")
    if expected is not None:
        assert result.status == "unsupported", f"{model_type} ({layout}) now passes: remove it from UNSUPPORTED"
        assert result.reason == expected
    else:
        assert result.status == "pass", f"{model_type} ({layout}) is refused: {result.reason}"
        assert result.stock_empty  # the uneven mesh really did leave stock expert ranks empty


@pytest.mark.parametrize("model_type, layout", [c for c in _cases() if c.values[1] is not None])
def test_fast_layout_equals_full_layout_on_the_saved_checkpoint(matrix, model_type, layout):
    """On what `save_pretrained` wrote, renaming one key per template gives the layout renaming every key gives
    (with more layers than layer kinds: tests/test_layout_fast.py)."""
    from reshard.read.checkpoint import read_checkpoint
    from reshard.errors import ReshardError
    from reshard.read.experts import build_meta_model, layout_from_model

    index = read_checkpoint(matrix.source(model_type, layout) or matrix.source(model_type, "original"))
    model = build_meta_model(index.config)
    layouts = []
    for by_template in (False, True):
        try:
            layouts.append(layout_from_model(model, index, by_template=by_template))
        except ReshardError as e:
            layouts.append(f"{type(e).__name__}: {e}")
    assert layouts[1] == layouts[0]


def test_discovery_finds_the_known_families_and_every_tiny_entry():
    found = {c.model_type: c for c in CANDIDATES}
    for model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4_text",
                       "dbrx", "granitemoe", "jamba", "olmoe", "phimoe"):
        assert model_type in found and found[model_type].skip is None, model_type
    assert set(breadth.TINY) <= set(found), sorted(set(breadth.TINY) - set(found))
    assert not [c.model_type for c in CANDIDATES if c.missing_tiny]
    for cand in CANDIDATES:  # nothing is dropped without a reason
        assert cand.skip is None or cand.skip.strip()


def test_unsupported_list_names_only_discovered_types():
    runnable = {c.model_type for c in breadth.runnable()}
    assert {t for t, _ in UNSUPPORTED} <= runnable


def test_readme_support_table_is_generated_from_these_results(matrix):
    """README.md carries `scripts/support_table.py`'s output between the support-table markers."""
    table = breadth.support_table(matrix)
    readme = breadth.readme_table(Path(__file__).parent.parent / "README.md")
    assert readme is not None, (f"README.md has no {breadth.TABLE_START} ... {breadth.TABLE_END} block; paste the "
                                f"output of `python scripts/support_table.py` between them:\n{table}")
    assert readme == table, f"README.md's support table is stale; replace it with:\n{table}"


VARIANTS = [  # not in the table: dtypes transformers keeps apart on disk, and tied embeddings
    pytest.param("deepseek_v3", "bfloat16", False, id="deepseek_v3-bf16-fp32-bias"),
    pytest.param("minimax_m2", "bfloat16", False, id="minimax_m2-bf16-bf16-bias"),
    pytest.param("ernie4_5_moe", "bfloat16", False, id="ernie4_5_moe-bf16-fp32-gate"),
    pytest.param("qwen3_moe", "float32", True, id="qwen3_moe-tied-embeddings"),
]


@pytest.mark.parametrize("model_type, dtype, tied", VARIANTS)
@pytest.mark.parametrize("layout", breadth.LAYOUTS)
def test_dtype_and_tied_variants(tmp_path, model_type, dtype, tied, layout):
    import torch
    from transformers import AutoModelForCausalLM

    from reshard.read.checkpoint import read_checkpoint

    src = breadth.generate(model_type, tmp_path / "f32", fused=False, tie_word_embeddings=tied)
    if dtype != "float32":  # from_pretrained(dtype=...) keeps `_keep_in_fp32_modules_strict` in fp32, as real releases
        src_dir = tmp_path / dtype
        AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype)).save_pretrained(
            src_dir, save_original_format=layout == "original")
        src = src_dir
        dtypes = {t.dtype for t in read_checkpoint(src).tensors.values()}
        assert "BF16" in dtypes and ("F32" in dtypes) == (model_type != "minimax_m2"), dtypes
    elif layout == "fused":
        src = breadth.generate(model_type, tmp_path / "fused", fused=True, tie_word_embeddings=tied)
    result = breadth.check_case(model_type, layout, src, tmp_path / "out")
    assert result.status == "pass", f"{result.reason}\n{result.steps[-1]}"


# ---- on real gloo processes: the families tests/test_loader.py does not load yet ----------------------------------

MULTIRANK = [  # model type, config overrides, fsdp, ep: stock transformers leaves expert ranks empty in each
    pytest.param("gpt_oss", {"num_local_experts": 2}, 4, 2, id="gpt_oss-fused-biases-2experts-ep2-fsdp4"),
    pytest.param("deepseek_v3", {"n_routed_experts": 6}, 4, 1, id="deepseek_v3-shared-bias-6experts-fsdp4"),
    pytest.param("llama4_text", {"num_local_experts": 2}, 4, 1, id="llama4_text-fused-2experts-fsdp4"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("model_type, overrides, fsdp, ep", MULTIRANK)
def test_family_loads_exactly_on_every_rank(tmp_path, model_type, overrides, fsdp, ep):
    from reshard.api import plan_checkpoint, write_checkpoint
    from reshard.plan.mesh import MeshSpec
    from reshard.plan.placement import box_is_empty
    from reshard.plan.layout import Role

    from test_loader import assert_loaded_exactly, load

    src = breadth.generate(model_type, tmp_path / "src", fused=False, **overrides)
    mesh = MeshSpec(fsdp=fsdp, ep=ep)
    plan = plan_checkpoint(src, mesh)
    assert any(box_is_empty(box) for tp in plan.tensors if tp.tensor.role is Role.EXPERT
               for box in tp.boxes(mesh, stock=True))
    out = tmp_path / "out"
    write_checkpoint(src, out, mesh, progress=False)
    _, reports = load("reshard", out, src, tmp_path, fsdp, ep)
    assert_loaded_exactly(reports, ep)
