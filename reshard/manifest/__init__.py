"""The manifest: `reshard.json` and the files it describes, built, validated and read in one place.

- `format`: the file names, the `DCP_SHARDING_INFO` header metadata and the document's JSON form;
- `document`: the manifest a write records (`build_manifest`), and `source_layout` its on-disk layout record;
- `validate`: every key, type and range checked before anything uses them (`validate_manifest`);
- `entries` and `parsed`: the typed view (`Manifest`, `read_manifest`) and the check of a header against it;
- `members`: plain file names, and the copied non-weight files checked through the folder's store;
- `coverage`: whether the chunks put every element somewhere exactly once.

The names below are the package's public ones: `from reshard.manifest import X` whichever module X lives in
(`format`'s `REMEDY`, `show` and `reject` serve the package's own messages).
"""

from .coverage import coverage_problem, coverage_problems, region_text
from .document import build_manifest, different_writes, joined_copies
from .entries import Chunk, CoordEntry, ExtrasEntry, FileEntry, SourceRecord, TensorInfo, chunk_of, placement_of
from .format import (DCP_SHARDING_INFO_KEY, DCP_VERSION, DCP_VERSION_KEY, EXTRA_FILE, MANIFEST_FORMAT, MANIFEST_NAME,
                     MANIFEST_VERSION, SAVED_OFFSETS_KEY, SHARD_FILE, SHARD_FILE_NAME, dcp_metadata, dump_manifest,
                     extra_file_name, shard_file_name)
from .members import copied_problems, plain_name_problem
from .parsed import MAX_MANIFEST_BYTES, Manifest, claimed_names, header_problems, read_manifest, write_label
from .source_layout import SOURCE_LAYOUT_VERSION, OnDisk, source_layout_record, tied_from_record
from .validate import validate_manifest

__all__ = [
    "Chunk", "CoordEntry", "DCP_SHARDING_INFO_KEY", "DCP_VERSION", "DCP_VERSION_KEY", "EXTRA_FILE", "ExtrasEntry",
    "FileEntry", "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_VERSION", "MAX_MANIFEST_BYTES", "Manifest", "OnDisk",
    "SAVED_OFFSETS_KEY", "SHARD_FILE", "SHARD_FILE_NAME", "SOURCE_LAYOUT_VERSION", "SourceRecord", "TensorInfo",
    "build_manifest", "different_writes", "joined_copies",
    "chunk_of", "claimed_names", "copied_problems", "coverage_problem", "coverage_problems",
    "dcp_metadata", "dump_manifest", "extra_file_name", "header_problems",
    "placement_of", "plain_name_problem", "read_manifest", "region_text", "shard_file_name", "source_layout_record",
    "tied_from_record", "validate_manifest", "write_label",
]
