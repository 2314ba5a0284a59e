"""Tiny random MoE checkpoints, generated locally (for `reshard demo` and the tests; nothing is downloaded).

Dimensions are small and pairwise distinct (hidden 64, expert FFN 24, dense FFN 96, vocab 512) so a transposed or
mis-split tensor shows up in its shape. Tensors transformers zero-initialises (router biases,
`e_score_correction_bias`, gpt-oss expert biases) are re-randomised: a consumer that drops them must not pass.
"""

from __future__ import annotations

from pathlib import Path

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, tie_word_embeddings=False)

# model_type -> (config overrides, config key holding the routed-expert count)
TINY = {
    "mixtral": (dict(num_local_experts=8, num_experts_per_tok=2), "num_local_experts"),
    "qwen3_moe": (dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=24), "num_experts"),
    "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=48), "num_experts"),
    "glm4_moe": (dict(n_routed_experts=10, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1), "n_routed_experts"),
    "deepseek_v3": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=1, num_key_value_heads=4, q_lora_rank=None,
                         kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=16), "n_routed_experts"),
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2), "num_local_experts"),
}


def make_tiny_checkpoint(model_type: str, path: str | Path, *, experts: int | None = None, fused: bool = False,
                         dtype: str = "float32", seed: int = 0, **overrides) -> Path:
    """Write a tiny random `model_type` checkpoint with `save_pretrained` and return its folder.

    Args:
        model_type: a key of `TINY`.
        path: the folder to write.
        experts: routed-expert count (default: the table's).
        fused: write the in-memory fused layout (`save_original_format=False`) instead of per-expert keys.
        dtype: `float32` or `bfloat16`.
        seed: the RNG seed; equal seeds give equal bytes.
        **overrides: further config fields.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs, expert_key = TINY[model_type]
    kwargs = {**BASE, **kwargs, **overrides}
    if experts is not None:
        kwargs[expert_key] = experts
        if model_type == "deepseek_v3" and experts % kwargs.get("n_group", 1):
            kwargs["n_group"] = 1
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and "rotary" not in name and not torch.count_nonzero(tensor):
                tensor.copy_(torch.randn(tensor.shape, dtype=torch.float32).to(tensor.dtype))
    path = Path(path)
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, save_original_format=not fused)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
    return path
