"""The breadth matrix: every MoE model type the installed transformers ships, as a tiny checkpoint, through reshard.

Used by `tests/test_breadth.py` and `scripts/support_table.py` (a plain module, not a test file).

- `discover()` finds the MoE model types in transformers itself: every model type of
  `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built on the meta device (config defaults plus the tiny overrides), and
  kept when the model's EP plan has an `ep_dispatch_experts` module or one of its modules is called `experts`, or
  when its config (or a sub-config) declares such an EP plan or has a field about experts (`num_experts`,
  `is_moe`, ...). Multimodal wrappers of a discovered text type, and config types with an EP plan outside the
  causal-LM mapping, are listed as skips with a reason. Nothing is dropped silently: a discovered type with no
  `TINY` entry is a `Candidate` with `missing_tiny=True`, which the tests fail on.
- `TINY` holds the tiny-config overrides per model type (hidden 64, 2 layers, 4 experts, small heads), following
  ARCHITECTURES.md section 6.9 (MLA models: `num_key_value_heads == num_attention_heads`; group routing: `n_group`
  divides the expert count; explicit `layer_types` / `mlp_layer_types`; dense-first-layer defaults turned so that
  layer 1 is MoE).
- `generate()` writes a checkpoint with `save_pretrained`: layout `original` (`save_original_format=True`, the
  published key layout: per-expert keys for most types) or `fused` (`save_original_format=False`, the in-memory
  keys; only where the two differ), after re-randomising every all-zero floating tensor except rotary ones
  (ARCHITECTURES.md 6.6).
- `check_case()` runs one (model type, layout): plan, write at two meshes (the uneven one in the balanced and the
  stock layout), verify against the source, load whole in one process and compare with transformers' own load;
  then merge each uneven folder back and write the balanced one again at the even mesh (`check_round_trip`).
  It returns a `CaseResult`; `support_table()` renders the results as the Markdown table the docs carry, one per
  tested transformers version (its first line names the version it was generated with).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from reshard.tiny import BASE as _TINY_BASE

# hidden 64, dense FFN 96, 2 layers, 4 heads (2 KV heads, head_dim 16), vocab 512, untied; pad id inside the vocab
BASE = {**_TINY_BASE, "pad_token_id": 0}

_E = 4  # routed experts: ep 2 fits, and fsdp 6 x ep 2 leaves stock expert ranks empty (see `meshes`)
_MOE = dict(moe_intermediate_size=24)
_MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, head_dim=8)  # rotary tables follow head_dim: it must equal qk_rope_head_dim
_INDEXER = dict(index_n_heads=2, index_head_dim=16, index_topk=4)
_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
_TWO = ["full_attention", "full_attention"]

# model_type -> tiny config overrides (on top of BASE)
TINY: dict[str, dict] = {
    "afmoe": dict(num_experts=_E, num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=8, **_MOE),
    "aria_text": dict(moe_num_experts=_E, moe_topk=2, moe_num_shared_experts=1, intermediate_size=24),
    "axk1": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                 mlp_layer_types=["dense", "sparse"], **_MLA, **_MOE),
    "axk2": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["dense", "sparse"],
                 layer_types=["indexed_attention", "indexed_attention"], **_MLA, **_INDEXER, **_MOE),
    "bailing_hybrid": dict(num_experts=_E, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2,
                           topk_group=1, first_k_dense_replace=1, mlp_layer_types=["dense", "sparse"],
                           layer_types=["linear_attention", "full_attention"], linear_head_dim=16, linear_num_heads=4,
                           layer_group_size=2, **_MLA, **_MOE),
    "beam": dict(num_experts=_E, num_experts_per_tok=2, n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse"],
                 layer_types=["sliding_attention", "full_attention"], sliding_window=8, **_MOE),
    "cohere2_moe": dict(num_experts=_E, num_experts_per_tok=2, num_shared_experts=1, intermediate_size=24,
                        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"],
                        sliding_window=8),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=24, moe_num_experts=_E, moe_top_k=2)),
    "deepseek_v2": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        **_MLA, **_MOE),
    "deepseek_v3": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, **_MLA, **_MOE),
    "deepseek_v32": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse"],
                         layer_types=["indexed_attention", "indexed_attention"], **_MLA, **_INDEXER, **_MOE),
    "deepseek_v4": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, num_key_value_heads=1,
                        q_lora_rank=32, o_groups=2, o_lora_rank=16, head_dim=16, qk_rope_head_dim=8,
                        layer_types=["sliding_attention", "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe"], sliding_window=8, index_n_heads=2, index_head_dim=16,
                        index_topk=4, hc_mult=2, num_nextn_predict_layers=0, **_MOE),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),
    "dots1": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  layer_types=_TWO, **_MOE),
    "dots3_note_text": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1,
                            mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention", "sliding_attention"],
                            shared_experts_intermediate_size=48, sliding_window=8, **_MLA, **_INDEXER,
                            **_MOE),
    "ernie4_5_moe": dict(moe_num_experts=_E, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
                         moe_layer_end_index=1, **_MOE),
    "exaone_moe": dict(num_experts=_E, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
                       layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                       sliding_window=8, **_MOE),
    # transformers 5.25: experts stored fused under other names, `up_proj` [E, hidden, inter], a per-expert norm
    "ergo": dict(num_experts=_E, num_experts_per_tok=2, num_dense_blocks=1, first_dense_intermediate_size=96,
                 shared_intermediate_size=48, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                 **_MOE),
    "flex_olmo": dict(num_experts=_E, num_experts_per_tok=2, intermediate_size=24),
    "flint": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                  layer_types=["full_attention", "sliding_attention"], sliding_window=8, **_MOE),
    "gemma4_text": dict(enable_moe_block=True, num_experts=_E, top_k_experts=2, layer_types=["sliding_attention",
                        "full_attention"], sliding_window=8, hidden_size_per_layer_input=0, per_layer_config={},
                        global_head_dim=16, **_MOE),
    "glm4_moe": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, **_MOE),
    "glm4_moe_lite": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1,
                          mlp_layer_types=["dense", "sparse"], **_MLA, **_MOE),
    "glm_moe_dsa": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention", "indexed_attention"],
                        **_MLA, **_INDEXER, **_MOE),
    "gpt_oss": dict(num_local_experts=_E, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=8),
    "granitemoe": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24),
    "granitemoe_swa": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24,
                           shared_intermediate_size=48, layer_types=["full_attention", "sliding_attention"],
                           sliding_window=8),
    "granitemoehybrid": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24,
                             shared_intermediate_size=48, layer_types=["mamba", "attention"], mamba_n_heads=8,
                             mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16),
    "granitemoeshared": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24,
                             shared_intermediate_size=48),
    "hunyuan_v1_moe": dict(num_experts=_E, moe_topk=2, intermediate_size=24),
    "hy_v3": dict(num_experts=_E, num_experts_per_tok=2, num_shared_experts=1, mlp_layer_types=["dense", "sparse"],
                  **_MOE),
    "hy_v4": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["dense", "sparse"],
                  layer_types=["indexed_attention", "indexed_attention"], indexer_types=["full", "shared"], hc_mult=2,
                  **{**_MLA, "q_lora_rank": 32}, **_INDEXER, **_MOE),
    # transformers 5.24: Inkling 2 with a looped middle (layer 1 runs twice; its message gates are dense)
    "inkling2_loop_text": dict(n_routed_experts=_E, num_experts_per_tok=2, swa_num_attention_heads=4,
                               swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8,
                               unpadded_vocab_size=512, layer_types=["hybrid_sliding", "hybrid"],
                               n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
                               loop_num_passes=2, loop_gate_rank=8, **_MOE),
    "inkling2_text": dict(n_routed_experts=_E, num_experts_per_tok=2, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, unpadded_vocab_size=512,
                          layer_types=["hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=1, **_MOE),
    "inkling_text": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, swa_num_attention_heads=4,
                         swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8,
                         layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["sparse", "sparse"], **_MOE),
    "jamba": dict(num_experts=_E, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                  attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False,
                  intermediate_size=24),
    "jetmoe": dict(num_local_experts=_E, num_experts_per_tok=2, kv_channels=16, intermediate_size=24),
    "kimi_linear": dict(num_experts=_E, num_experts_per_token=2, num_shared_experts=1, mlp_layer_types=["dense",
                        "sparse"], layer_types=["linear_attention", "full_attention"], linear_head_dim=16,
                        linear_num_heads=4, **_MLA, **_MOE),
    "kolibri1": dict(num_local_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=8, **_MOE),
    "kolibri1_1": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48,  # transformers 5.25
                       mlp_only_layers=[0], mlp_only_intermediate_size=96, head_dim=16, sliding_window=8,
                       layer_types=["sliding_attention", "indexed_attention"], index_layers=[1], kv_source_layers=[0, 1],
                       index_topk=4, index_pool_size=16, index_compression=2, index_num_heads=2,
                       index_num_local_tokens=4, index_num_sink_tokens=2, **_MOE),
    "laguna": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48, layer_types=_TWO,
                   num_attention_heads_per_layer=[4, 4], mlp_layer_types=["dense", "sparse"], **_MOE),
    "lara_mini": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48,  # transformers 5.24
                      layer_types=["linear_attention", "full_attention"], sliding_window=8, **_LINEAR, **_MOE),
    "lfm2_moe": dict(num_experts=_E, num_experts_per_tok=2, num_dense_layers=1, layer_types=["conv", "full_attention"],
                     **_MOE),
    "llama4_text": dict(num_local_experts=_E, num_experts_per_tok=1, intermediate_size=24, intermediate_size_mlp=96,
                        interleave_moe_layer_step=2, moe_layers=None, layer_types=["chunked_attention",
                        "full_attention"], attention_chunk_size=8),
    "longcat_flash": dict(n_routed_experts=_E, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=24,
                          ffn_hidden_size=96, num_layers=1, **_MLA),
    "mellum": dict(num_local_experts=_E, num_experts_per_tok=2, layer_types=_TWO, mlp_layer_types=["sparse", "sparse"],
                   **_MOE),
    "mimo_v2_flash": dict(n_routed_experts=_E, num_experts_per_tok=2, v_head_dim=16,
                          layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
                          sliding_window=8, **_MOE),
    "minimax": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24,
                    layer_types=["linear_attention", "full_attention"]),
    "minimax_m2": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24),
    "minimax_m3_vl_text": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24,
                               dense_intermediate_size=96, shared_intermediate_size=48,
                               mlp_layer_types=["dense", "sparse"], layer_types=_TWO, index_n_heads=2,
                               index_head_dim=16),
    "minicpm5_moe": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1,  # transformers 5.25
                         mlp_layer_types=["dense", "sparse"], head_dim=16, **_MOE),
    "mixtral": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24),
    "nemotron_h": dict(n_routed_experts=_E, num_experts_per_tok=2, moe_intermediate_size=24,
                       moe_shared_expert_intermediate_size=48, layers_block_type=["full_attention", "moe"],
                       mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16),
    "olmoe": dict(num_experts=_E, num_experts_per_tok=2, intermediate_size=24),
    "param2moe": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1,  # transformers 5.25
                      first_k_dense_replace=1, head_dim=16, **_MOE),
    "phimoe": dict(num_local_experts=_E, num_experts_per_tok=2, intermediate_size=24),
    "qwen2_moe": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48, **_MOE),
    "qwen3_5_moe_text": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48,
                             layer_types=["linear_attention", "full_attention"], **_LINEAR, **_MOE),
    "qwen3_moe": dict(num_experts=_E, num_experts_per_tok=2, **_MOE),
    "qwen3_next": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48,
                       layer_types=["linear_attention", "full_attention"], **_LINEAR, **_MOE),
    "qwen4_exp_text": dict(num_experts=_E, num_experts_per_tok=2, shared_expert_intermediate_size=48,
                           layer_types=["linear_attention", "full_attention"], hc_lowrank=8, ple_embed_dim=16,
                           heads_per_ngram=2, ngram_vocab_size_base=512,
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2, **_LINEAR, **_MOE),
    "sarvam_mla": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1,  # transformers 5.24
                       first_k_dense_replace=1, **_MLA, **_MOE),
    "sarvam_moe": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1,  # transformers 5.24
                       first_k_dense_replace=1, **_MOE),
    "solar_open": dict(n_routed_experts=_E, num_experts_per_tok=2, n_shared_experts=1, **_MOE),
    "zaya": dict(num_experts=_E, num_experts_per_tok=1, layer_types=["hybrid", "hybrid"], router_hidden_size=16,
                 **_MOE),
}


# ---- configs, meta models, discovery ------------------------------------------------------------------------------

def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def known_model_types() -> frozenset[str]:
    """The model types the installed transformers has a config for (`TINY` also holds newer releases' types)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


def tiny_config(model_type: str):
    """The config class's defaults with BASE and the `TINY` overrides (BASE only when the type has no entry)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**{**BASE, **TINY.get(model_type, {})})


def causal_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


@lru_cache(maxsize=None)
def meta_model(model_type: str):
    """The causal-LM model of `model_type` built from `tiny_config` on the meta device (one build per type)."""
    import torch

    _quiet()
    with torch.device("meta"):
        return causal_class(model_type)(tiny_config(model_type))


def ep_expert_modules(model) -> list[str]:
    """Modules the model's EP plan dispatches to experts (`ep_dispatch_experts`), `*` matched against layer numbers."""
    patterns = [re.compile(re.escape(k).replace(r"\*", r"\d+")) for k, v in (model.ep_plan or {}).items()
                if v == "ep_dispatch_experts"]
    return [name for name, _ in model.named_modules() if any(p.fullmatch(name) for p in patterns)]


def ep_expert_params(model) -> set[str]:
    """Every parameter under an `ep_dispatch_experts` module: what reshard must call experts, and nothing else."""
    return {f"{m}.{p}" for m in ep_expert_modules(model) for p, _ in model.get_submodule(m).named_parameters()}


def experts_submodules(model) -> list[str]:
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"]


def fsdp_only_expert_params(model) -> set[str]:
    """Without an EP plan, the stacked (2-D or more) parameters under `experts` modules: FSDP chunks them on dim 0."""
    return {f"{m}.{p}" for m in experts_submodules(model)
            for p, t in model.get_submodule(m).named_parameters()
            if t.ndim >= 2 and not re.search(r"(^|\.)(router|gate)\.", p)}  # a nested router is not an expert


@dataclass
class Candidate:
    """One MoE model type found in transformers.

    Attributes:
        model_type: the config's model type.
        class_name: its causal-LM class (None outside the causal-LM mapping).
        skip: why it is not run (None when it is).
        missing_tiny: discovered as MoE but `TINY` has no overrides for it (a failure, never silent).
        has_ep_plan: the model's EP plan names an `ep_dispatch_experts` module.
    """

    model_type: str
    class_name: str | None
    skip: str | None = None
    missing_tiny: bool = False
    has_ep_plan: bool = True


def _config_declares_ep(config_class) -> bool:
    plan = getattr(config_class, "base_model_ep_plan", None) or {}
    return "ep_dispatch_experts" in plan.values()


def _sub_config_types(config_class) -> list[str]:
    return [t for t in (getattr(sub, "model_type", None) for sub in (getattr(config_class, "sub_configs", None)
                                                                       or {}).values()) if t]


def _config_names_experts(config_class) -> bool:
    """The config (a dataclass in transformers 5) has a field about experts (`num_experts`, `is_moe`, ...)."""
    import dataclasses

    try:
        return any("expert" in f.name or f.name.startswith("is_moe") for f in dataclasses.fields(config_class))
    except TypeError:
        return False


@lru_cache(maxsize=None)
def discover() -> tuple[Candidate, ...]:
    """The MoE model types of the installed transformers, sorted by model type (see the module docstring).

    A causal-LM type is MoE when its tiny meta build has an `ep_dispatch_experts` module in its EP plan or a module
    called `experts`, or (whether it builds or not) its config or a sub-config declares an `ep_dispatch_experts` EP
    plan or has a config field naming experts.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _quiet()
    found: dict[str, Candidate] = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type not in CONFIG_MAPPING_NAMES:
            continue
        config_class = CONFIG_MAPPING[model_type]
        by_config = _config_declares_ep(config_class) or _config_names_experts(config_class) or any(
            _config_declares_ep(CONFIG_MAPPING[t]) for t in _sub_config_types(config_class)
            if t in CONFIG_MAPPING_NAMES)
        try:
            model = meta_model(model_type)
        except Exception:  # noqa: BLE001 - a type that does not build tiny is classified by its config alone
            model = None
        has_ep = model is not None and bool(ep_expert_modules(model))
        by_model = model is not None and (has_ep or bool(experts_submodules(model)))
        if by_model or by_config or model_type in TINY:
            found[model_type] = Candidate(model_type, class_name, has_ep_plan=has_ep,
                                          missing_tiny=model_type not in TINY)
    # wrappers: a causal type whose config holds a sub-config that is itself a discovered type
    for model_type, cand in found.items():
        subs = [t for t in _sub_config_types(CONFIG_MAPPING[model_type]) if t in found and t != model_type]
        if subs and model_type not in TINY:
            cand.skip = f"multimodal wrapper: its MoE text model `{subs[0]}` is tested as its own type"
            cand.missing_tiny = False
    # config types outside the causal-LM mapping whose config or sub-config declares an EP plan
    for model_type in CONFIG_MAPPING_NAMES:
        if model_type in found or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001
            continue
        subs = [t for t in _sub_config_types(config_class) if t in CONFIG_MAPPING_NAMES
                and _config_declares_ep(CONFIG_MAPPING[t])]
        if _config_declares_ep(config_class):
            found[model_type] = Candidate(model_type, None, skip="not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: no "
                                          "AutoModelForCausalLM class to generate and compare with")
        elif subs:
            found[model_type] = Candidate(model_type, None, skip=f"not a causal LM (multimodal model; its MoE part "
                                          f"is `{subs[0]}`)")
    return tuple(sorted(found.values(), key=lambda c: c.model_type))


# ---- checkpoints ----------------------------------------------------------------------------------------------------

def generate(model_type: str, path: str | Path, *, fused: bool, seed: int = 0, **overrides) -> Path:
    """Write a tiny random `model_type` checkpoint (float32) and return its folder (`overrides`: config fields)."""
    import torch

    _quiet()
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = causal_class(model_type)(config)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and "rotary" not in name and tensor.numel() and \
                    not torch.count_nonzero(tensor):
                tensor.copy_(torch.randn(tensor.shape, dtype=torch.float32).to(tensor.dtype))
        model(torch.tensor([[1, 5, 9, 33, 7, 2, 100, 42]]))  # the tiny config must give a working model
    path = Path(path)
    model.save_pretrained(path, save_original_format=not fused)
    return path


def _pattern_stem(pattern: str) -> str:
    """The literal text a `_keys_to_ignore_on_load_unexpected` regex starts with: `model\\.layers\\.61.*` ->
    `model.layers.61` (anchors, `(^|\\.)` and optional groups dropped)."""
    text = pattern.replace("(^|\\.)", "")
    text = re.sub(r"\([^)]*\)\?", "", text)
    return text.replace(".*", "").replace("\\.", ".").strip("^$.")


def unloaded_keys(model_type: str) -> dict[str, str]:
    """On-disk keys `model_type`'s class ignores on load (issue 23: MTP layers), two per pattern of its
    `_keys_to_ignore_on_load_unexpected`: a matrix and a norm of an MTP-like layer. Key -> the pattern it matches."""
    patterns = getattr(causal_class(model_type), "_keys_to_ignore_on_load_unexpected", None)
    out = {}
    for pattern in sorted(patterns) if isinstance(patterns, (list, tuple, set)) else ():
        for leaf in ("eh_proj.weight", "enorm.weight"):
            key = f"{_pattern_stem(pattern)}.{leaf}"
            assert re.search(pattern, key), f"{model_type}: {key} does not match {pattern!r}"
            out[key] = pattern
    return out


def add_unloaded(model_type: str, folder: Path) -> Path:
    """Add `unloaded_keys(model_type)` to a generated checkpoint (F32 matrices, BF16 norms: dtypes kept apart)."""
    import torch

    from reshard.tiny import add_tensors

    generator = torch.Generator().manual_seed(23)
    tensors = {key: torch.randn((8, 16) if key.endswith("eh_proj.weight") else (16,), generator=generator)
               for key in unloaded_keys(model_type)}
    return add_tensors(folder, {k: v.bfloat16() if k.endswith("enorm.weight") else v for k, v in tensors.items()})


def saved_keys(folder: Path) -> set[str]:
    from reshard.read._source import read_checkpoint

    return set(read_checkpoint(folder).tensors)


def layouts_differ(model_type: str, original: Path) -> bool:
    """Whether `save_original_format=False` would write other keys than the original-format save did."""
    return saved_keys(original) - set(unloaded_keys(model_type)) != set(meta_model(model_type).state_dict())


def expert_count(layout) -> int:
    return layout.experts[0].shape[0]


def meshes(num_experts: int):
    """Two meshes: one where stock transformers leaves some rank's experts empty, one that splits them evenly.

    With an even expert count both use ep 2: `fsdp = E + 2` gives efsdp `E/2 + 1` over `E/2` experts (one empty),
    `fsdp = E` gives one expert per rank. Otherwise no EP: `fsdp = E + 1` and `fsdp = E`.
    """
    from reshard.plan import MeshSpec

    if num_experts % 2 == 0:
        return {"uneven": MeshSpec(fsdp=num_experts + 2, ep=2), "even": MeshSpec(fsdp=num_experts, ep=2)}
    return {"uneven": MeshSpec(fsdp=num_experts + 1), "even": MeshSpec(fsdp=num_experts)}


@contextmanager
def _closing_leaked_fds():
    """Close the file descriptors a call leaves open.

    Workaround for a leak in `reshard.verification._compare_with_source` (`fds.setdefault(path, os.open(path))` opens the
    file again on every run): about 1,800 descriptors per tiny verify, so the matrix hits the open-files limit.
    """
    before = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    try:
        yield
    finally:
        if before is not None:
            for fd in set(os.listdir("/proc/self/fd")) - before:
                try:
                    if os.path.isfile(os.readlink(f"/proc/self/fd/{fd}")):
                        os.close(int(fd))
                except OSError:
                    pass


# ---- one case -------------------------------------------------------------------------------------------------------

@dataclass
class CaseResult:
    """What `check_case` found for one (model type, layout).

    Attributes:
        status: `pass`, `unsupported` (reshard refused it with a ReshardError) or `fail`.
        reason: the ReshardError message (unsupported) or the failure (fail).
        experts: routed experts per MoE layer, expert tensors per layer, MoE layers (from the plan).
        expert_names: one layer's expert tensor names (the part after `experts.`).
        stock_empty: stock transformers leaves a rank's experts empty at the `uneven` mesh.
        seconds: time spent.
    """

    model_type: str
    layout: str
    status: str = "fail"
    reason: str = ""
    experts: tuple[int, int, int] | None = None
    expert_names: tuple[str, ...] = ()
    stock_empty: bool | None = None
    expert_parallel: bool | None = None
    seconds: float = 0.0
    steps: list[str] = field(default_factory=list)


def _expert_summary(layout):
    from reshard.plan._placement import family_of

    experts = layout.experts
    layers = sorted({re.search(r"\.(\d+)\.", t.name).group(1) for t in experts if re.search(r"\.(\d+)\.", t.name)},
                    key=int)
    families = sorted({family_of(t.name) for t in experts})
    names = tuple(sorted({f.split("experts.", 1)[-1] for f in families}))
    per_layer = len(experts) // max(len(layers), 1)
    return (experts[0].shape[0], per_layer, len(layers)), names


NO_EP_PLAN = "the model's EP plan names no `ep_dispatch_experts` module, so reshard finds no routed experts"


def check_case(model_type: str, layout: str, src: Path, work: Path) -> CaseResult:
    """Plan, write at two meshes (the uneven one in both layout modes), verify and load `src`.

    `src` is a checkpoint of `model_type` in `layout`. Problems are recorded in the result, never raised.
    """
    import torch

    from reshard.api import plan_checkpoint, write_checkpoint
    from reshard.errors import ReshardError
    from reshard.plan import Role
    from reshard.load import from_pretrained
    from reshard.plan import MeshSpec
    from reshard.plan import box_is_empty, make_plan
    from reshard.api import verify

    def clean(message: str) -> str:  # no temporary paths in reasons: the support table must be reproducible
        return str(message).replace(str(work), "<out>").replace(str(src), "<src>")

    _quiet()
    result = CaseResult(model_type, layout)
    start = time.monotonic()
    try:
        try:
            plan = plan_checkpoint(src, MeshSpec(fsdp=2)).plan
        except ReshardError as e:
            result.status, result.reason = "unsupported", clean(e)
            return result
        if plan is None:
            assert not ep_expert_params(meta_model(model_type)), "plan_checkpoint missed the EP plan's experts"
            try:
                write_checkpoint(src, work / "refused", MeshSpec(fsdp=2), progress=False)
            except ReshardError as e:
                result.status, result.reason = "unsupported", f"{NO_EP_PLAN}; write: {clean(e)}"
            else:
                raise AssertionError("write_checkpoint wrote a checkpoint in which plan_checkpoint found no experts")
            return result
        result.steps.append("plan")
        # exactly the keys the model class ignores on load are kept as extras (none where it ignores none)
        from reshard.read._source import read_checkpoint

        extras = {t.name for t in plan.layout.extras}
        assert extras == set(unloaded_keys(model_type)) & set(read_checkpoint(src).tensors), \
            f"extras found: {sorted(extras)[:4]}, class-ignored keys: {sorted(unloaded_keys(model_type))[:4]}"
        result.experts, result.expert_names = _expert_summary(plan.layout)
        result.expert_parallel = plan.layout.expert_parallel
        # exactly the EP plan's expert parameters are experts; routers, shared experts and biases are not
        found = {t.name for t in plan.layout.experts}
        expected = ep_expert_params(meta_model(model_type))
        assert plan.layout.expert_parallel == bool(expected)
        if not expected:  # no EP plan: the experts FSDP alone shards, planned for ep = 1
            expected = fsdp_only_expert_params(meta_model(model_type))
        assert found == expected, (f"experts found beyond the EP plan's: {sorted(found - expected)[:4]}, "
                                   f"EP-plan experts missed: {sorted(expected - found)[:4]}")
        for t in plan.layout.tensors:
            if re.search(r"shared_expert|shared_mlp|e_score_correction_bias|expert_bias|router|\.gate\.", t.name):
                assert t.role is not Role.EXPERT, f"{t.name} is not a routed expert"
        result.steps.append("experts")
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
        sizes = {t.shape[0] for t in plan.layout.experts}
        if plan.layout.expert_parallel:
            case_meshes = meshes(expert_count(plan.layout))
        else:  # FSDP only; expert tensors may differ on dim 0 (LongCat's zero experts): even = their gcd
            case_meshes = {"uneven": MeshSpec(fsdp=max(sizes) + 1), "even": MeshSpec(fsdp=math.gcd(*sizes))}
        for mesh_name, mesh in case_meshes.items():
            stock = make_plan(plan.layout, mesh, mode="stock")
            empty = any(box_is_empty(box) for tp in stock.tensors if tp.tensor.role is Role.EXPERT
                        for box in tp.boxes(mesh, stock=True))
            assert empty == (mesh_name == "uneven"), f"{mesh.describe()}: stock empty expert ranks: {empty}"
            if mesh_name == "uneven":
                result.stock_empty = empty
            for mode in ("balanced", "stock") if mesh_name == "uneven" else ("balanced",):
                out = work / f"{mesh_name}-{mode}"
                write_checkpoint(src, out, mesh, mode=mode, progress=False)
                with _closing_leaked_fds():
                    verify(out, against=src)
                loaded = from_pretrained(out).state_dict()
                assert loaded.keys() == reference.keys(), \
                    f"keys differ: {sorted(loaded.keys() ^ reference.keys())[:4]}"
                for name, tensor in reference.items():
                    assert loaded[name].dtype == tensor.dtype, f"{name}: {loaded[name].dtype} != {tensor.dtype}"
                    assert torch.equal(loaded[name], tensor), f"{name} differs after loading {out.name}"
                result.steps.append(f"{out.name}: written, verified, loaded")
                if mesh_name == "uneven":  # the way back out (issue 14): merge, and from mesh to mesh
                    check_round_trip(src, out, work / f"{out.name}-back", case_meshes["even"] if mode == "balanced"
                                     else None, reference)
                    result.steps.append(f"{out.name}: merged back" + (", and through the even mesh" if mode ==
                                                                     "balanced" else ""))
                del loaded
                shutil.rmtree(out, ignore_errors=True)
        result.status = "pass"
    except Exception as e:  # noqa: BLE001 - recorded; the test fails on it
        result.status = "fail"
        result.reason = clean(f"{type(e).__name__}: {e}".strip())
        result.steps.append(traceback.format_exc(limit=-8))
    finally:
        result.seconds = time.monotonic() - start
    return result


def _saved_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _assert_same_tensors(found: dict, expected: dict, what: str) -> None:
    import torch

    assert found.keys() == expected.keys(), (f"{what}: keys differ: missing {sorted(expected.keys() - found.keys())[:3]}"
                                             f", extra {sorted(found.keys() - expected.keys())[:3]}")
    for key, tensor in expected.items():
        assert found[key].dtype == tensor.dtype and torch.equal(found[key], tensor), f"{what}: {key} differs"


def check_round_trip(src: Path, folder: Path, work: Path, second_mesh, reference: dict) -> None:
    """`reshard merge` of a written folder gives the source back: its key set, every tensor `torch.equal`.

    With `second_mesh`, also from mesh to mesh: the folder written again at `second_mesh` (`write` reading the reshard
    folder), merged in the original layout (and `verify --against` the source) and in the fused layout (equal to
    transformers' own load of the source, `reference`, tied copies left out as save_pretrained does).
    """
    import torch

    from reshard.api import write_checkpoint
    from reshard.api import merge_checkpoint
    from reshard.api import verify

    source = _saved_tensors(src)
    merge_checkpoint(folder, work / "merged", progress=False, max_shard_size=100_000)
    _assert_same_tensors(_saved_tensors(work / "merged"), source, f"merge of {folder.name}")
    if second_mesh is not None:
        write_checkpoint(folder, work / "second", second_mesh, progress=False)
        merge_checkpoint(work / "second", work / "merged", progress=False, overwrite=True)
        _assert_same_tensors(_saved_tensors(work / "merged"), source, f"merge of {folder.name} via {second_mesh}")
        verify(work / "merged", against=src)
        merge_checkpoint(work / "second", work / "merged", progress=False, overwrite=True, layout="fused")
        fused = _saved_tensors(work / "merged")
        unloaded = {k: source[k] for k in set(fused) - set(reference) if k in source}  # extras: their own keys
        _assert_same_tensors({k: v for k, v in fused.items() if k not in unloaded},
                             {k: v for k, v in reference.items() if k in fused}, "fused merge")
        _assert_same_tensors({k: fused[k] for k in unloaded}, unloaded, "fused merge's extras")
        for name in set(reference) - set(fused):  # only tied copies are left out, their bytes stored once
            assert any(torch.equal(reference[name], t) for t in fused.values()), f"fused merge: {name} is missing"
    shutil.rmtree(work, ignore_errors=True)


# ---- the matrix and its table ---------------------------------------------------------------------------------------

LAYOUTS = ("original", "fused")


class Matrix:
    """Checkpoints and results per (model type, layout), generated on first use under `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.sources: dict[tuple[str, str], Path | None] = {}
        self.results: dict[tuple[str, str], CaseResult] = {}

    def source(self, model_type: str, layout: str) -> Path | None:
        """The checkpoint of `model_type` in `layout`, or None when the layouts coincide (fused == original)."""
        key = (model_type, layout)
        if key not in self.sources:
            original = self.root / model_type / "original"
            if (model_type, "original") not in self.sources:
                self.sources[(model_type, "original")] = add_unloaded(model_type, generate(model_type, original,
                                                                                           fused=False))
            if layout == "fused":
                differ = layouts_differ(model_type, original)
                self.sources[key] = add_unloaded(model_type, generate(model_type, self.root / model_type / "fused",
                                                                      fused=True)) \
                    if differ else None
        return self.sources[key]

    def result(self, model_type: str, layout: str) -> CaseResult | None:
        key = (model_type, layout)
        if key not in self.results:
            try:
                src = self.source(model_type, layout)
            except Exception as e:  # noqa: BLE001
                self.results[key] = CaseResult(model_type, layout, "fail", f"generation failed: "
                                               f"{type(e).__name__}: {e}", steps=[traceback.format_exc(limit=-6)])
                return self.results[key]
            if src is None:
                return None
            self.results[key] = check_case(model_type, layout, src, self.root / model_type / f"out-{layout}")
        return self.results[key]

    def run_all(self, progress=None) -> list[CaseResult]:
        out = []
        for cand in runnable():
            for layout in LAYOUTS:
                r = self.result(cand.model_type, layout)
                if r is not None:
                    out.append(r)
                    if progress:
                        progress(r)
        return out


def runnable() -> list[Candidate]:
    return [c for c in discover() if c.skip is None and not c.missing_tiny]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


_RESULT = {"pass": "yes", "unsupported": "unsupported", "fail": "FAIL"}


def support_table(matrix: Matrix) -> str:
    """The Markdown support table from the matrix's results: every discovered type, skipped ones included."""
    lines = [version_line(), "",
             "| model type | layouts tested | experts found per layer | result | reason if unsupported |",
             "|---|---|---|---|---|"]
    for cand in discover():
        if cand.skip is not None or cand.missing_tiny:
            reason = cand.skip or "discovered as MoE but tests/breadth.py TINY has no tiny config for it"
            lines.append(f"| {cand.model_type} | - | - | {'skipped' if cand.skip else 'FAIL'} | {_cell(reason)} |")
            continue
        results = [r for r in (matrix.result(cand.model_type, layout) for layout in LAYOUTS) if r is not None]
        layouts = ", ".join(r.layout for r in results) + (" (= fused)" if len(results) == 1 else "")
        found = next((r for r in results if r.experts), None)
        if found:
            e, _, layers = found.experts
            total = getattr(tiny_config(cand.model_type), "num_hidden_layers", None)
            experts = f"{e} × {', '.join(found.expert_names)} ({layers} of {total} layers)"
        else:
            experts = "none"
        statuses = {r.status for r in results}
        if len(statuses) == 1:
            result = _RESULT[statuses.pop()]
            reasons = sorted({_cell(r.reason) for r in results if r.status != "pass"})
        else:
            result = "; ".join(f"{r.layout}: {_RESULT[r.status]}" for r in results)
            reasons = [f"{r.layout}: {_cell(r.reason)}" for r in results if r.status != "pass"]
        if found and found.expert_parallel is False and "yes" in result:
            result = result.replace("yes", "yes, ep 1 only (transformers has no EP plan for it)")
        lines.append(f"| {cand.model_type} | {layouts} | {experts} | {result} | {'; '.join(reasons)} |")
    return "\n".join(lines)


TABLE_START = "<!-- support-table:start -->"
TABLE_END = "<!-- support-table:end -->"


_VERSION_LINE = re.compile(r"Generated with transformers (\S+) by ")


def version_line() -> str:
    """The table's first line: which model types exist, and how each converts, depends on the transformers release."""
    import transformers

    return f"Generated with transformers {transformers.__version__} by `python scripts/support_table.py`."


@dataclass(frozen=True)
class DocTable:
    """One support table found in a Markdown file, between the markers."""

    path: Path
    version: str | None  # the transformers version its first line names; None: the line is missing
    text: str


def document_tables(paths) -> list[DocTable]:
    """Every support-table block in `paths` (README.md and docs/*.md), in file order."""
    found = []
    for path in paths:
        for chunk in Path(path).read_text().split(TABLE_START)[1:]:
            text = chunk.split(TABLE_END, 1)[0].strip()
            match = _VERSION_LINE.match(text)
            found.append(DocTable(Path(path), match.group(1) if match else None, text))
    return found


def table_for_version(paths, version: str) -> str | None:
    """The text of the one support table in `paths` generated with transformers `version` (None: there is none)."""
    tables = [t for t in document_tables(paths) if t.version == version]
    return tables[0].text if len(tables) == 1 else None
