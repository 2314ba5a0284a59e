"""Recognise quantized checkpoints from metadata and describe them as the bf16 checkpoint they stand for.

Pure: config and headers in, plain data out (the arithmetic is in `reshard.runs._dequant`). Two formats:

- FP8 block-scaled (`quant_method: fp8` with `weight_block_size: [bm, bn]`; DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8,
  GLM-FP8, MiniMax-M2): a weight `W` in F8_E4M3 (or F8_E5M2) of shape `[..., rows, cols]` beside `W_scale_inv`
  (F32, BF16 or F16) of shape `[..., ceil(rows / bm), ceil(cols / bn)]`. `W` stands for a bf16 tensor of the same
  key and shape: `bf16(fp32(w) * scale[i // bm, j // bn])`. The last block of a dim may be partial.
- MXFP4 (`quant_method: mxfp4`; gpt-oss): `P_blocks` U8 `[E, out, G, 16]` (two e2m1 values per byte, the low
  nibble first) beside `P_scales` U8 `[E, out, G]` (an e8m0 exponent per 32 values, bias 127). They stand for the
  bf16 parameter `P` of shape `[E, G * 32, out]`: transformers dequantizes to `[E, out, G * 32]` and transposes.

`dequantized_view` turns the checkpoint's index into the index of that bf16 checkpoint (the quantized pairs become
one virtual bf16 entry each, `config.json` loses `quantization_config`), so planning, the layout and the manifest
are exactly those of the bf16 model transformers builds for that config without quantization.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from ._checkpoint import CheckpointIndex
from ._safetensors_header import TensorEntry
from ..errors import QuantizationError

_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_FP8_SCALE_DTYPES = ("F32", "BF16", "F16")
_FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_BLOCK = 32  # values per e8m0 scale
_SUPPORTED_METHODS = ("fp8", "mxfp4")
OUTPUT_DTYPES = ("bf16",)


@dataclass(frozen=True)
class QuantizedTensor:
    """A bf16 tensor `write --dequantize` computes from a quantized pair of on-disk tensors.

    Attributes:
        name: the key the bf16 checkpoint has (the FP8 weight's own key; for MXFP4 the parameter, `P` of `P_blocks`).
        shape: the bf16 shape.
        method: `fp8` or `mxfp4`.
        data: the FP8 weight, or the MXFP4 blocks.
        scale: the `_scale_inv` tensor, or the MXFP4 scales.
        block: FP8: `(bm, bn)`, rows and columns per scale; MXFP4: `(1, 32)`.
    """

    name: str
    shape: tuple[int, ...]
    method: str
    data: TensorEntry
    scale: TensorEntry
    block: tuple[int, int]

    def record(self) -> dict:
        """What the manifest says of it (`dequantized_from`)."""
        return {"method": self.method, "dtype": self.data.dtype, "scale_dtype": self.scale.dtype,
                "block": list(self.block), "keys": [self.data.name, self.scale.name],
                **({"transposed": True} if self.method == "mxfp4" else {})}


@dataclass(frozen=True)
class _Quantization:
    """A checkpoint's quantization, as found in its config and headers.

    Attributes:
        method: `fp8` or `mxfp4`.
        config: `config.json`'s `quantization_config`, as it was.
        tensors: every quantized tensor by its bf16 key, in key order.
    """

    method: str
    config: dict
    tensors: dict[str, QuantizedTensor]

    def computes(self, tensor) -> bool:
        """Whether a planned tensor has a quantized piece: its chunks are computed, not copied."""
        return any(p.source in self.tensors for p in tensor.pieces)

    @property
    def quantized_bytes(self) -> int:
        return sum(q.data.nbytes + q.scale.nbytes for q in self.tensors.values())

    def describe(self) -> str:
        if self.method == "fp8":
            dtypes = sorted({q.data.dtype for q in self.tensors.values()})
            block = self.config.get("weight_block_size")
            return f"FP8 ({'/'.join(dtypes)}) with block scales, {block[0]}x{block[1]} per scale"
        return "MXFP4 (e2m1 values, an e8m0 scale per 32)"


def detect_quantization(index: CheckpointIndex) -> _Quantization | None:
    """The checkpoint's quantization, or None when `config.json` has no `quantization_config`.

    Raises:
        QuantizationError: an unknown `quant_method`; FP8 without `weight_block_size`; a quantized tensor without
            its scale, a scale without its tensor; a scale grid that does not cover its weight; unexpected dtypes.
    """
    qc = index.config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"{index.source}: config.json's quantization_config is not an object.",
                                path=index.source)
    method = qc.get("quant_method")
    if method == "fp8":
        tensors = _fp8_tensors(index, _block_size(index, qc))
    elif method == "mxfp4":
        tensors = _mxfp4_tensors(index)
    else:
        raise QuantizationError(
            f"{index.source}: quant_method {method!r} is not supported; reshard dequantizes "
            f"{' and '.join(_SUPPORTED_METHODS)} (block-scaled FP8 as DeepSeek-V3 ships it, MXFP4 as gpt-oss does). "
            "Dequantize it with its own tools first, or open an issue with the config.", path=index.source)
    if not tensors:
        raise QuantizationError(f"{index.source}: config.json says quant_method {method!r}, but no tensor is stored "
                                "quantized; remove quantization_config from config.json if the weights are not.",
                                path=index.source)
    return _Quantization(method, dict(qc), dict(sorted(tensors.items())))


def _block_size(index: CheckpointIndex, qc: dict) -> tuple[int, int]:
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise QuantizationError(
            f"{index.source}: quant_method fp8 needs weight_block_size [rows, cols] in quantization_config (got "
            f"{block!r}); reshard dequantizes block-scaled FP8 only, not per-tensor or per-channel scales.",
            path=index.source)
    return block[0], block[1]


def _fp8_tensors(index: CheckpointIndex, block: tuple[int, int]) -> dict[str, QuantizedTensor]:
    bm, bn = block
    out = {}
    for key, scale in index.tensors.items():
        if not key.endswith(_FP8_SCALE_SUFFIX):
            continue
        name = key[:-len(_FP8_SCALE_SUFFIX)]
        data = index.tensors.get(name)
        if data is None:
            raise QuantizationError(f"{scale.file}: scale {key!r} has no weight {name!r} beside it; the checkpoint is "
                                    "incomplete.", path=scale.file)
        if data.dtype not in _FP8_DTYPES:
            raise QuantizationError(f"{data.file}: {name!r} is {data.dtype} but has a scale {key!r}; reshard "
                                    f"dequantizes FP8 weights ({', '.join(_FP8_DTYPES)}).", path=data.file)
        if scale.dtype not in _FP8_SCALE_DTYPES:
            raise QuantizationError(f"{scale.file}: scale {key!r} is {scale.dtype}; reshard reads "
                                    f"{', '.join(_FP8_SCALE_DTYPES)} block scales.", path=scale.file)
        if len(data.shape) < 2:
            raise QuantizationError(f"{data.file}: FP8 {name!r} has shape {list(data.shape)}; block scales need at "
                                    "least 2 dims.", path=data.file)
        *lead, rows, cols = data.shape
        grid = (*lead, -(-rows // bm), -(-cols // bn))
        if tuple(scale.shape) != grid:
            raise QuantizationError(
                f"{scale.file}: scale {key!r} has shape {list(scale.shape)}, but {name!r} {list(data.shape)} in "
                f"{bm}x{bn} blocks (weight_block_size) needs {list(grid)}: the scale grid does not cover the weight. "
                "Check weight_block_size in config.json against the checkpoint.", path=scale.file)
        out[name] = QuantizedTensor(name, tuple(data.shape), "fp8", data, scale, block)
    for key, data in index.tensors.items():
        if data.dtype in _FP8_DTYPES and key not in out:
            raise QuantizationError(f"{data.file}: FP8 tensor {key!r} has no scale {key + _FP8_SCALE_SUFFIX!r}; the "
                                    "checkpoint is incomplete (download the missing file) or not block-scaled.",
                                    path=data.file)
    return out


def _mxfp4_tensors(index: CheckpointIndex) -> dict[str, QuantizedTensor]:
    out = {}
    for key, blocks in index.tensors.items():
        if not key.endswith("_blocks"):
            continue
        name = key[:-len("_blocks")]
        scales = index.tensors.get(f"{name}_scales")
        if scales is None:
            raise QuantizationError(f"{blocks.file}: MXFP4 {key!r} has no scales {name + '_scales'!r} beside it; the "
                                    "checkpoint is incomplete.", path=blocks.file)
        if blocks.dtype != "U8" or scales.dtype != "U8":
            raise QuantizationError(f"{blocks.file}: MXFP4 {key!r} ({blocks.dtype}) and its scales ({scales.dtype}) "
                                    "must both be U8.", path=blocks.file)
        if len(blocks.shape) != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2:
            raise QuantizationError(f"{blocks.file}: MXFP4 {key!r} has shape {list(blocks.shape)}; expected "
                                    f"[experts, out, groups, {MXFP4_BLOCK // 2}].", path=blocks.file)
        if tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise QuantizationError(f"{scales.file}: MXFP4 scales {name + '_scales'!r} have shape "
                                    f"{list(scales.shape)}, but {key!r} {list(blocks.shape)} needs "
                                    f"{list(blocks.shape[:-1])}: the scale grid does not cover the blocks.",
                                    path=scales.file)
        experts, rows, groups, _ = blocks.shape
        out[name] = QuantizedTensor(name, (experts, groups * MXFP4_BLOCK, rows), "mxfp4", blocks, scales,
                                    (1, MXFP4_BLOCK))
    for key, scales in index.tensors.items():
        if key.endswith("_scales") and key[:-len("_scales")] not in out and scales.dtype == "U8":
            raise QuantizationError(f"{scales.file}: MXFP4 scales {key!r} have no blocks "
                                    f"{key[:-len('_scales')] + '_blocks'!r} beside them; the checkpoint is "
                                    "incomplete.", path=scales.file)
    return out


def dequantized_view(index: CheckpointIndex, quantization: _Quantization) -> CheckpointIndex:
    """The index of the bf16 checkpoint `index` stands for: each quantized pair becomes one BF16 entry (its
    `data_start` is the quantized data's; `quantized` says how to compute it), and the config loses
    `quantization_config`."""
    hidden = set()
    for q in quantization.tensors.values():
        hidden.update((q.data.name, q.scale.name))
    tensors = {k: v for k, v in index.tensors.items() if k not in hidden}
    for name, q in quantization.tensors.items():
        if name in tensors:
            raise QuantizationError(f"{index.source}: {name!r} is stored both quantized and as is.",
                                    path=index.source)
        tensors[name] = TensorEntry(name, q.data.file, "BF16", q.shape, q.data.data_start)
    config = copy.deepcopy(index.config)
    config.pop("quantization_config", None)
    return replace(index, config=config, tensors=tensors, quantization=quantization)


def dequantized_config(config: dict) -> dict:
    """`config.json` for the written bf16 folder: no `quantization_config`, bf16 weights."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    keys = [key for key in ("torch_dtype", "dtype") if key in out] or ["dtype"]
    for key in keys:
        out[key] = "bfloat16"
    return out
