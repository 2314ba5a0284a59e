"""The dtype table every size is computed from: bits per element of each dtype safetensors knows.

It sits in `plan` because the plan is the lowest layer that sizes chunks; the readers of headers and of the manifest
take it from here. Sub-byte dtypes (F4, F6_*) are known but refused where a chunk would cut into a byte
(`reshard.read._safetensors_header._check_dtype`).
"""

from __future__ import annotations

DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
