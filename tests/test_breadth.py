"""Breadth: every MoE model type of the installed transformers that builds tiny, in both layouts, through reshard.

Per (model type, layout), from `breadth.check_case`: `plan_checkpoint` finds exactly the EP plan's expert parameters;
`write_checkpoint` at a mesh where stock transformers leaves expert ranks empty (balanced and stock layouts) and at
an even one; `verify(out, against=src)`; a single-process `reshard.from_pretrained(out)` equals transformers' own
load of the source, tensor by tensor. Model types reshard refuses are listed in `UNSUPPORTED` with the exact reason.
The support table the docs carry for the installed transformers version must be the one these results give
(`scripts/support_table.py` prints it); CI runs this file at both ends of the tested transformers range.
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
    # transformers 5.24: the original checkpoints store some tensors fused, which transformers splits on load
    ("lara_mini", "original"): "lara_mini: model.layers.0.linear_attn.in_proj_qkv.weight is one part of an on-disk "
                               "tensor that transformers splits (Split of ['linear_attn.in_proj'] into "
                               "['linear_attn.in_proj_qkv', 'linear_attn.in_proj_z', 'linear_attn.in_proj_b', "
                               "'linear_attn.in_proj_a']); reshard builds each tensor from whole on-disk tensors, so a "
                               "checkpoint storing them fused is not supported yet (one saved with the in-memory "
                               "names, save_pretrained(save_original_format=False), is). Nothing was written.",
    ("sarvam_moe", "original"): "sarvam_moe: model.layers.0.self_attn.q_proj.weight is one part of an on-disk tensor "
                                "that transformers splits (Split of ['query_key_value'] into ['q_proj', 'k_proj', "
                                "'v_proj']); reshard builds each tensor from whole on-disk tensors, so a checkpoint "
                                "storing them fused is not supported yet (one saved with the in-memory names, "
                                "save_pretrained(save_original_format=False), is). Nothing was written.",
    # transformers 5.25: Param2-MoE stores `query_key_value` fused as Sarvam-MoE does; Ergo its router and shared
    # expert transposed ([in, out] on disk)
    ("param2moe", "original"): "param2moe: model.layers.0.self_attn.q_proj.weight is one part of an on-disk tensor "
                               "that transformers splits (Split of ['query_key_value'] into ['q_proj', 'k_proj', "
                               "'v_proj']); reshard builds each tensor from whole on-disk tensors, so a checkpoint "
                               "storing them fused is not supported yet (one saved with the in-memory names, "
                               "save_pretrained(save_original_format=False), is). Nothing was written.",
    ("ergo", "original"): "ergo: model.layers.1.mlp.gate.linear.weight is stored transposed (transformers "
                          "transposes on-disk feed_forward.gate_kernel as it loads); reshard copies whole on-disk "
                          "tensors byte for byte and does not transpose, so a checkpoint storing them transposed is "
                          "not supported yet (one saved with the in-memory names, "
                          "save_pretrained(save_original_format=False), is). Nothing was written.",
    # transformers 5.24: NVFP4/MXFP8 experts dequantized by transformers' own op, then interleaved as Inkling 2's
    ("inkling2_loop_text", "original"): "inkling2_loop_text: model.layers.0.mlp.experts.gate_up_proj is built with "
                                        "['Inkling2LoopDequantizeExperts', 'Interleave'] (transformers dequantizes "
                                        "the NVFP4/MXFP8 experts of the original checkpoints as it loads them); "
                                        "reshard does not compose them yet, so this model type is not supported "
                                        "yet. Nothing was written.",
}
# Model types of a newer transformers than the installed one (their TINY and UNSUPPORTED entries wait unused).
KNOWN = set(breadth.known_model_types())


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
    from reshard.read._source import read_checkpoint
    from reshard.errors import ReshardError
    from reshard.read._experts import build_meta_model, layout_from_model

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
    assert set(breadth.TINY) & KNOWN <= set(found), sorted(set(breadth.TINY) & KNOWN - set(found))
    assert not [c.model_type for c in CANDIDATES if c.missing_tiny]
    for cand in CANDIDATES:  # nothing is dropped without a reason
        assert cand.skip is None or cand.skip.strip()


def test_unsupported_list_names_only_discovered_types():
    runnable = {c.model_type for c in breadth.runnable()}
    assert {t for t, _ in UNSUPPORTED} & KNOWN <= runnable


ROOT = Path(__file__).parent.parent


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_support_table_of_this_transformers_is_generated_from_these_results(matrix):
    """README.md or docs/*.md carry `scripts/support_table.py`'s output for the installed transformers, between the
    support-table markers; every table there names the transformers version it was generated with."""
    import transformers

    table = breadth.support_table(matrix)
    assert table.splitlines()[0] == breadth.version_line() and transformers.__version__ in table.splitlines()[0]
    tables = breadth.document_tables(doc_files())
    unnamed = sorted({str(t.path.relative_to(ROOT)) for t in tables if t.version is None})
    assert not unnamed, (f"{unnamed}: a support table whose first line names no transformers version; replace it "
                         f"with the output of `python scripts/support_table.py` (first line: {breadth.version_line()})")
    mine = [t for t in tables if t.version == transformers.__version__]
    assert len(mine) == 1, (f"{len(mine)} support tables for transformers {transformers.__version__} in README.md and "
                            f"docs/*.md (want 1); paste this one between {breadth.TABLE_START} and "
                            f"{breadth.TABLE_END} in docs/compatibility.md:\n{table}")
    assert mine[0].text == table, (f"{mine[0].path.relative_to(ROOT)}: the support table for transformers "
                                   f"{transformers.__version__} is stale; replace it with:\n{table}")


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

    from reshard.read._source import read_checkpoint

    src = breadth.generate(model_type, tmp_path / "f32", fused=False, tie_word_embeddings=tied)
    if dtype != "float32":  # from_pretrained(dtype=...) keeps `_keep_in_fp32_modules_strict` in fp32, as real releases
        src_dir = tmp_path / dtype
        AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype), use_kernels=False).save_pretrained(
            src_dir, save_original_format=layout == "original")
        src = src_dir
        dtypes = {t.dtype for t in read_checkpoint(src).tensors.values()}
        assert "BF16" in dtypes and ("F32" in dtypes) == (model_type != "minimax_m2"), dtypes
    elif layout == "fused":
        src = breadth.generate(model_type, tmp_path / "fused", fused=True, tie_word_embeddings=tied)
    result = breadth.check_case(model_type, layout, src, tmp_path / "out")
    assert result.status == "pass", f"{result.reason}\n{result.steps[-1]}"


# ---- on real gloo processes: the families tests/test_loader.py does not load yet ----------------------------------

MULTIRANK = [  # model type, config overrides, fsdp, ep, fused: stock transformers leaves expert ranks empty in each
    pytest.param("gpt_oss", {"num_local_experts": 2}, 4, 2, False, id="gpt_oss-fused-biases-2experts-ep2-fsdp4"),
    pytest.param("deepseek_v3", {"n_routed_experts": 6}, 4, 1, False, id="deepseek_v3-shared-bias-6experts-fsdp4"),
    pytest.param("llama4_text", {"num_local_experts": 2}, 4, 1, False, id="llama4_text-fused-2experts-fsdp4"),
    # transformers 5.25: Ergo's experts (up_proj [E, hidden, inter], a per-expert norm) in the layout it loads;
    # MiniCPM5-MoE's per-expert keys merged on load
    pytest.param("ergo", {"num_experts": 6}, 4, 1, True, id="ergo-fused-expert-norm-6experts-fsdp4"),
    pytest.param("minicpm5_moe", {"n_routed_experts": 6}, 4, 1, False, id="minicpm5_moe-shared-6experts-fsdp4"),
]
MULTIRANK = [case for case in MULTIRANK if case.values[0] in KNOWN]  # a newer release's types wait for it


@pytest.mark.slow  # each family on 4 ranks
@pytest.mark.multirank
@pytest.mark.parametrize("model_type, overrides, fsdp, ep, fused", MULTIRANK)
def test_family_loads_exactly_on_every_rank(tmp_path, model_type, overrides, fsdp, ep, fused):
    from reshard.api import plan_checkpoint, write_checkpoint
    from reshard.plan import MeshSpec
    from reshard.plan import box_is_empty
    from reshard.plan import Role

    from test_loader import assert_loaded_exactly, load

    src = breadth.generate(model_type, tmp_path / "src", fused=fused, **overrides)
    mesh = MeshSpec(fsdp=fsdp, ep=ep)
    plan = plan_checkpoint(src, mesh).plan
    assert any(box_is_empty(box) for tp in plan.tensors if tp.tensor.role is Role.EXPERT
               for box in tp.boxes(mesh, stock=True))
    out = tmp_path / "out"
    write_checkpoint(src, out, mesh, progress=False)
    _, reports = load("reshard", out, src, tmp_path, fsdp, ep)
    assert_loaded_exactly(reports, ep)
