"""Read sources: a checkpoint's headers (local or Hub), quantized pairs as the bf16 tensors they stand for,
folders in the distributed-checkpoint layout, and the map from on-disk keys to the model's tensors.

Its interface is `__all__`, imported from the package (`from reshard.read import X`); its modules are private
(`_name.py`) and used inside `read` only.
"""

from ._checkpoint import CheckpointIndex, INDEX_NAME, SourceKind, TORCH_DTYPE_NAMES, is_metadata_file, torch_dtype
from ._content import sampled_crc
from ._dcp_source import DcpIndex
from ._experts import find_experts
from ._joined import JoinedStore
from ._places import Place, local_place, place_of, refuse_overlap, s3_prefix
from ._quant import MXFP4_BLOCK, OUTPUT_DTYPES, QuantizedTensor, dequantized_config
from ._range_file import DEPTH, RANGE
from ._ranges import ByteRange, Piece
from ._remote import ATTEMPTS, BACKOFF_S, READ_TIMEOUT_S, S3Store, transient
from ._safetensors_header import FileHeader, MAX_HEADER_BYTES, TensorEntry, header_of, json_document, parse_header
from ._source import DISTRIBUTED, Folder, S3_SCHEMES, is_url, locate, open_folder, open_source, s3_filesystem
from ._store import HEADER_PROBE, LocalStore, READ_BLOCK, Store

__all__ = [
    "ATTEMPTS", "BACKOFF_S", "ByteRange", "CheckpointIndex", "DEPTH", "DISTRIBUTED", "DcpIndex", "FileHeader",
    "Folder", "HEADER_PROBE", "INDEX_NAME", "JoinedStore", "LocalStore", "MAX_HEADER_BYTES", "MXFP4_BLOCK",
    "OUTPUT_DTYPES", "Piece", "Place", "QuantizedTensor", "RANGE", "READ_BLOCK", "READ_TIMEOUT_S", "S3Store", "S3_SCHEMES",
    "SourceKind", "Store", "TORCH_DTYPE_NAMES", "TensorEntry", "dequantized_config", "find_experts", "header_of",
    "is_metadata_file", "is_url", "json_document", "local_place", "locate", "open_folder", "open_source",
    "parse_header", "place_of", "refuse_overlap", "s3_filesystem", "s3_prefix", "sampled_crc", "torch_dtype",
    "transient",
]
