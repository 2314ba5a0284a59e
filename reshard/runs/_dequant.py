"""Compute bf16 chunks from quantized sources, a bounded slab at a time (the arithmetic of `write --dequantize`).

A chunk whose tensor has a quantized piece cannot be copied as byte runs; it is computed instead, in slabs of at
most `SLAB_BYTES` of output that are contiguous in the chunk's bytes (`slabs`). Each slab reads only the source
rows and scale rows it needs, so memory does not grow with the tensor or the checkpoint.

The conversion is a table lookup, exact by construction: every output element is a function of one stored byte
and one scale, so for each scale block a 256-entry table of finished bf16 values (computed with the very torch ops
transformers uses: `bf16(fp32(w) * fp32(scale))` for FP8, `ldexp(e2m1, e - 127)` in bf16 for MXFP4) is built and
the bytes are looked up (`numpy.take`), one pass, no per-element float arithmetic.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Iterator

import numpy as np

from ..read import (CheckpointIndex, MXFP4_BLOCK, QuantizedTensor, TORCH_DTYPE_NAMES, TensorEntry,
                    torch_dtype as checkpoint_torch_dtype)
from ..plan import Box, DTYPE_BITS, TargetTensor, box_is_empty
from ..errors import OutputError, QuantizationError
from ..syscalls import pread_full

SLAB_BYTES = 32 << 20  # output bytes computed at once; the source rows and lookup indices add about 3x that
# e2m1, indexed by the 4-bit code (sign in the high bit), as transformers' FP4_VALUES
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def torch_dtype(dtype: str):
    """The torch dtype of a safetensors dtype string, or a `QuantizationError` naming what this torch lacks."""
    import torch

    found = checkpoint_torch_dtype(dtype)
    if found is None:
        name = TORCH_DTYPE_NAMES.get(dtype, dtype)
        raise QuantizationError(f"{dtype}: this torch ({torch.__version__}) has no {name} dtype, "
                                "which reshard needs to decode these weights. Install a torch that has it "
                                "(float8 dtypes arrived in torch 2.1).")
    return found


def check_decodable(index: CheckpointIndex) -> None:
    """Fail before anything is written when a quantized dtype cannot be decoded with the installed torch."""
    quantization = index.quantization
    if quantization is None:
        return
    for dtype in sorted({q.data.dtype for q in quantization.tensors.values() if q.method == "fp8"}
                        | {q.scale.dtype for q in quantization.tensors.values() if q.method == "fp8"}):
        torch_dtype(dtype)


def slabs(box: Box, itemsize: int, budget: int = SLAB_BYTES) -> Iterator[Box]:
    """Sub-boxes of `box` that tile it in row-major order, each contiguous in the chunk's bytes and at most `budget`
    bytes (or one row of the innermost dim, when that alone is larger)."""
    lengths = [n for _, n in box]
    inner, k = itemsize, len(lengths)
    while k > 0 and inner * lengths[k - 1] <= budget:
        inner *= lengths[k - 1]
        k -= 1
    if k == 0:
        yield box
        return
    d = k - 1  # the dim cut into blocks; dims before it are taken one index at a time
    per = max(1, budget // inner)
    for prefix in itertools.product(*(range(n) for n in lengths[:d])):
        for start in range(0, lengths[d], per):
            yield (*((box[j][0] + prefix[j], 1) for j in range(d)), (box[d][0] + start, min(per, lengths[d] - start)),
                   *box[d + 1:])


class Dequantizer:
    """Computes regions of a dequantized checkpoint's tensors from the source files (one per writer)."""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self.quantized: dict[str, QuantizedTensor] = dict(index.quantization.tensors) if index.quantization else {}
        self.fds: dict[str, int | None] = {}  # None: a remote file, read through the store
        self._fp8_values: dict[str, object] = {}
        self._mxfp4_table = None
        self._scratch_arrays: dict[str, np.ndarray] = {}
        self._turn = 0

    def _scratch(self, name: str, shape, dtype) -> np.ndarray:
        """A reused buffer (fresh pages cost a fault each: allocating per slab was a third of the time)."""
        n = math.prod(shape)
        held = self._scratch_arrays.get(name)
        if held is None or held.dtype != dtype or held.size < n:
            held = self._scratch_arrays[name] = np.empty(n, dtype=dtype)
        return held[:n].reshape(shape)

    def computes(self, tensor: TargetTensor) -> bool:
        """Whether `tensor` has a quantized piece (its chunks are computed, not copied)."""
        return self.index.quantization is not None and self.index.quantization.computes(tensor)

    def close(self) -> None:
        for fd in self.fds.values():
            if fd is not None:
                os.close(fd)
        self.fds.clear()

    # ---- reading ------------------------------------------------------------------------------------------------

    def _read(self, entry: TensorEntry, first: int, count: int, scratch: str | None = None) -> np.ndarray:
        """`count` bytes of `entry`'s data from byte `first` (relative to the tensor), as uint8; into the reused
        buffer `scratch` when given (valid until the next read into it)."""
        out = np.empty(count, dtype=np.uint8) if scratch is None else self._scratch(scratch, (count,), np.uint8)
        if entry.file not in self.fds:
            local = self.index.store.local_path(entry.file) is not None  # the file its header was read from
            self.fds[entry.file] = self.index.store.descriptor(entry.file) if local else None
        if self.fds[entry.file] is None:  # a remote source: one ranged request per slab's rows
            self.index.store.readinto(entry.file, entry.data_start + first, memoryview(out))
            return out
        if pread_full(self.fds[entry.file], memoryview(out), entry.data_start + first) < count:
            raise OutputError(f"{entry.file}: short read in {entry.name!r}; the source file is truncated or "
                              "changed during the write.")
        return out

    def _plain(self, entry: TensorEntry, lo: list[int], hi: list[int]):
        """The region `[lo, hi)` of a tensor stored as is, read row block by row block."""
        import torch

        shape, itemsize = entry.shape, DTYPE_BITS[entry.dtype] // 8
        last = max((j for j in range(len(shape)) if (lo[j], hi[j]) != (0, shape[j])), default=0)
        inner = math.prod(shape[last + 1:])
        strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
        parts = []
        for prefix in itertools.product(*(range(lo[j], hi[j]) for j in range(last))):
            first = sum(i * s for i, s in zip(prefix, strides)) + lo[last] * strides[last] if shape else 0
            count = (hi[last] - lo[last]) * inner if shape else 1
            parts.append(self._read(entry, first * itemsize, count * itemsize))
        raw = np.concatenate(parts) if len(parts) != 1 else parts[0]
        return torch.from_numpy(raw).view(torch_dtype(entry.dtype)).reshape([h - l for l, h in zip(lo, hi)])

    # ---- FP8 ----------------------------------------------------------------------------------------------------

    def _fp8_table_values(self, dtype: str):
        """fp32 value of each of the 256 codes of an FP8 dtype (torch's own conversion)."""
        import torch

        if dtype not in self._fp8_values:
            codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
            self._fp8_values[dtype] = codes.view(torch_dtype(dtype)).to(torch.float32)
        return self._fp8_values[dtype]

    def _fp8(self, q: QuantizedTensor, lo: list[int], hi: list[int], out: np.ndarray) -> None:
        """Write into `out` (int16: bf16 bits) the FP8 weight's region `[lo, hi)`:
        `bf16(fp32(w) * scale[i // bm, j // bn])`."""
        import torch

        *lead, rows, cols = q.shape
        bm, bn = q.block
        srows, scols = -(-rows // bm), -(-cols // bn)
        r0, r1, c0, c1 = lo[-2], hi[-2], lo[-1], hi[-1]
        cb0, cb1 = c0 // bn, -(-c1 // bn)
        rb0, rb1 = r0 // bm, -(-r1 // bm)
        col_lo, col_hi = cb0 * bn, min(cols, cb1 * bn)  # whole column blocks around [c0, c1)
        col_base = ((np.arange(col_hi - col_lo, dtype=np.int32) // bn) * 256)[None, :]
        whole = (c0, c1) == (col_lo, col_hi)
        values = self._fp8_table_values(q.data.dtype)
        scale_dtype = torch_dtype(q.scale.dtype)
        scale_size = DTYPE_BITS[q.scale.dtype] // 8
        for prefix in itertools.product(*(range(a, b) for a, b in zip(lo[:-2], hi[:-2]))):
            matrix = sum(i * math.prod(lead[j + 1:]) for j, i in enumerate(prefix)) if lead else 0
            raw = self._read(q.data, (matrix * rows + r0) * cols, (r1 - r0) * cols, "fp8").reshape(r1 - r0, cols)
            raw = raw[:, col_lo:col_hi]
            scale = self._read(q.scale, (matrix * srows + rb0) * scols * scale_size, (rb1 - rb0) * scols * scale_size)
            scale = torch.from_numpy(scale).view(scale_dtype).reshape(rb1 - rb0, scols)[:, cb0:cb1].to(torch.float32)
            # one table of finished bf16 bits per (row block, column block): the product and rounding transformers do
            tables = (values[None, None, :] * scale[:, :, None]).to(torch.bfloat16).view(torch.int16).numpy()
            target = out[tuple(i - l for i, l in zip(prefix, lo))] if lead else out
            for rb in range(rb0, rb1):
                a, b = max(r0, rb * bm) - r0, min(r1, (rb + 1) * bm) - r0
                index = np.add(raw[a:b], col_base, out=self._scratch("index", (b - a, col_hi - col_lo), np.int32))
                if whole:
                    np.take(tables[rb - rb0].reshape(-1), index, out=target[a:b], mode="clip")
                else:
                    target[a:b] = np.take(tables[rb - rb0].reshape(-1), index, mode="clip")[:, c0 - col_lo:c1 - col_lo]

    # ---- MXFP4 --------------------------------------------------------------------------------------------------

    def _mxfp4_pairs(self) -> np.ndarray:
        """uint32 table indexed by `scale << 8 | byte`: the two bf16 values of the byte (low nibble in the low half,
        the first element in memory), each `ldexp(e2m1, scale - 127)` computed as transformers does, in bf16."""
        import torch

        if self._mxfp4_table is None:
            values = torch.tensor(_E2M1_VALUES, dtype=torch.bfloat16).repeat(256, 1)  # [scale, code]
            exponents = (torch.arange(256, dtype=torch.int32) - 127)[:, None]
            torch.ldexp(values, exponents, out=values)
            bits = values.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)  # [256, 16]
            byte = np.arange(256)
            self._mxfp4_table = (bits[:, byte & 0x0F] | (bits[:, byte >> 4] << 16)).reshape(-1)
        return self._mxfp4_table

    def _mxfp4(self, q: QuantizedTensor, lo: list[int], hi: list[int], out: np.ndarray) -> None:
        """Write into `out` (int16: bf16 bits) the region `[lo, hi)` of the parameter `[E, in, out]`, from blocks
        `[E, out, G, 16]`."""
        experts, width, rows = q.shape
        groups = width // MXFP4_BLOCK
        (e0, i0, o0), (e1, i1, o1) = lo, hi
        g0, g1 = i0 // MXFP4_BLOCK, -(-i1 // MXFP4_BLOCK)
        table = self._mxfp4_pairs()
        half = MXFP4_BLOCK // 2
        for e in range(e0, e1):
            first_row = e * rows + o0
            blocks = self._read(q.data, first_row * groups * half, (o1 - o0) * groups * half, "mxfp4")
            blocks = blocks.reshape(o1 - o0, groups, half)[:, g0:g1]
            scales = self._read(q.scale, first_row * groups, (o1 - o0) * groups).reshape(o1 - o0, groups)[:, g0:g1]
            index = np.bitwise_or(np.left_shift(scales.astype(np.int32), 8)[:, :, None], blocks, dtype=np.int32)
            pairs = np.take(table, index, mode="clip")  # [out, groups, 16] uint32: 32 bf16 values per group
            values = pairs.view(np.int16).reshape(o1 - o0, (g1 - g0) * MXFP4_BLOCK)
            out[e - e0] = values[:, i0 - g0 * MXFP4_BLOCK:i1 - g0 * MXFP4_BLOCK].T

    # ---- regions and chunks -------------------------------------------------------------------------------------

    def region(self, key: str, lo: list[int], hi: list[int], out: np.ndarray | None = None):
        """The values of source tensor `key` (in the bf16 view) over `[lo, hi)`, as a torch tensor; or, with `out`
        (a numpy array of the region's shape, int16 for bf16 bits), written into it."""
        import torch

        q = self.quantized.get(key)
        if q is None:
            values = self._plain(self.index.tensors[key], lo, hi)
            if out is None:
                return values
            out[...] = values.view(torch.int16).numpy() if values.dtype == torch.bfloat16 else values.numpy()
            return out
        result = out if out is not None else np.empty([h - l for l, h in zip(lo, hi)], dtype=np.int16)
        (self._fp8 if q.method == "fp8" else self._mxfp4)(q, lo, hi, result)
        return torch.from_numpy(result).view(torch.bfloat16) if out is None else out

    def chunk_slabs(self, tensor: TargetTensor, box: Box) -> Iterator[memoryview]:
        """The bytes of `tensor`'s chunk `box`, in order, a slab of at most `SLAB_BYTES` bytes at a time.

        Slabs live in two reused buffers taken in turn: a slab may be consumed (written, checksummed) while the next
        one is computed, and must be done with before the one after that is asked for.
        """
        if box_is_empty(box):
            return
        if tensor.dtype != "BF16":  # a computed tensor is bf16 throughout (layout: one dtype per tensor)
            raise AssertionError(f"{tensor.name}: computed tensors are BF16, not {tensor.dtype}")
        for slab in slabs(box, 2, SLAB_BYTES):
            # bf16 bits, in one of two buffers taken in turn: a slab stays valid while the next one is computed
            self._turn ^= 1
            out = self._scratch(f"slab{self._turn}", [n for _, n in slab], np.int16)
            filled = 0
            for piece in tensor.pieces:
                entry = self.index.tensors[piece.source]
                extent = tensor.piece_shape(piece, entry.shape)
                lo = [max(b, o) for (b, _), o in zip(slab, piece.offset)]
                hi = [min(b + n, o + e) for (b, n), o, e in zip(slab, piece.offset, extent)]
                if any(h <= l for l, h in zip(lo, hi)):
                    continue
                src_lo = [l - o for l, o in zip(lo, piece.offset)]
                src_hi = [h - o for h, o in zip(hi, piece.offset)]
                if piece.stacked_dim is not None:
                    del src_lo[piece.stacked_dim], src_hi[piece.stacked_dim]
                target = out[tuple(slice(l - b, h - b) for l, h, (b, _) in zip(lo, hi, slab))]
                if piece.stacked_dim is not None:
                    target = target.squeeze(piece.stacked_dim)
                self.region(piece.source, src_lo, src_hi, out=target)
                filled += target.size
            if filled != out.size:
                raise AssertionError(f"{tensor.name}: pieces fill {filled} of {out.size} elements of {slab}")
            yield memoryview(out.reshape(-1).view(np.uint8))
