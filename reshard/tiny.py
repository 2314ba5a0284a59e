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


def add_tensors(folder: str | Path, tensors: dict) -> Path:
    """Add `tensors` (key -> torch tensor) to the single-file checkpoint in `folder`: what a release carries beside
    the weights the model loads (MTP layers, ...), which `save_pretrained` never writes."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    state = load_file(path)
    clash = sorted(set(state) & set(tensors))
    if clash:
        raise ValueError(f"{path}: already holds {clash[:3]}")
    save_file({**state, **{k: v.contiguous() for k, v in tensors.items()}}, path, metadata={"format": "pt"})
    return Path(folder)


_E4M3_MAX = 448.0


def quantize_checkpoint(src: str | Path, dest: str | Path, *, method: str, block: tuple[int, int] = (128, 128),
                        seed: int = 0) -> Path:
    """Write `src` (a bf16 tiny checkpoint) into `dest` in a shipped quantized format, as the real releases do.

    - `fp8`: every linear weight of the decoder layers (attention, dense MLP, routed and shared experts; fused
      expert tensors too) becomes F8_E4M3 beside an F32 `<key>_scale_inv` of `ceil(rows / bm) x ceil(cols / bn)`
      blocks, partial edge blocks included (DeepSeek-V3's format); embeddings, norms, routers and lm_head stay.
    - `mxfp4`: gpt-oss's fused expert weights `[E, in, out]` become `<key>_blocks` U8 `[E, out, in / 32, 16]` and
      `<key>_scales` U8 `[E, out, in / 32]` (e2m1 codes, the low nibble first, an e8m0 exponent per 32 values).

    `config.json` gains the `quantization_config` the releases carry. Other files are copied.
    """
    import json
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for file in sorted(src.glob("*.safetensors")):
        out = {}
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if method == "fp8" and _fp8_target(key, tensor):
                    out[key], out[f"{key}_scale_inv"] = _quantize_fp8(tensor, block)
                elif method == "mxfp4" and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    out[f"{key}_blocks"], out[f"{key}_scales"] = _quantize_mxfp4(tensor, generator)
                else:
                    out[key] = tensor
        save_file(out, dest / file.name, metadata={"format": "pt"})
        weight_map.update({key: file.name for key in out})
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy2(path, dest / path.name)
    if (src / "model.safetensors.index.json").exists():
        total = sum((dest / name).stat().st_size for name in set(weight_map.values()))
        (dest / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    _add_quantization_config(dest / "config.json", method, block)
    return dest


def _add_quantization_config(path: Path, method: str, block: tuple[int, int]) -> None:
    """The `quantization_config` the releases of each format carry, in `config.json`."""
    import json

    config = json.loads(path.read_text())
    if method == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
    else:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    path.write_text(json.dumps(config, indent=2))


def _fp8_target(key: str, tensor) -> bool:
    if ".layers." not in key or "norm" in key or tensor.ndim < 2 or not tensor.is_floating_point():
        return False
    if key.endswith(("mlp.gate.weight", "router.weight")) or "e_score_correction_bias" in key:
        return False
    return key.endswith(".weight") or key.endswith(("experts.gate_up_proj", "experts.down_proj"))


def _quantize_fp8(tensor, block: tuple[int, int]):
    """F8_E4M3 codes and F32 scales (`w ~ fp32(q) * scale` per block), partial edge blocks included."""
    import torch

    bm, bn = block
    *lead, rows, cols = tensor.shape
    grid = (-(-rows // bm), -(-cols // bn))
    padded = torch.zeros(*lead, grid[0] * bm, grid[1] * bn, dtype=torch.float32)
    padded[..., :rows, :cols] = tensor.float()
    blocks = padded.reshape(*lead, grid[0], bm, grid[1], bn)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / _E4M3_MAX, torch.ones_like(amax))
    codes = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :rows, :cols]
    return codes.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def _quantize_mxfp4(tensor, generator):
    """gpt-oss's packing of a `[E, in, out]` weight: nearest e2m1 codes per 32 inputs under an e8m0 exponent."""
    import torch

    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    weight = tensor.float().transpose(1, 2).contiguous()  # [E, out, in]
    experts, rows, width = weight.shape
    groups = weight.reshape(experts, rows, width // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exponent = (torch.floor(torch.log2(amax / 6.0)) + 127).clamp(1, 254)
    exponent += torch.randint(0, 2, exponent.shape, generator=generator)  # some groups clip at +-6: all codes used
    scaled = groups / torch.exp2(exponent - 127)[..., None]
    codes = (scaled.abs()[..., None] - values).abs().argmin(dim=-1)
    codes = codes | ((scaled < 0).to(torch.int64) << 3)
    pairs = codes.reshape(experts, rows, width // 32, 16, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return packed.contiguous(), exponent.to(torch.uint8).contiguous()
