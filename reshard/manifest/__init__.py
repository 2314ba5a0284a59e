"""The manifest: `reshard.json` and the files it describes, built, validated and read in one place.

- `_format`: the file names, the `DCP_SHARDING_INFO` header metadata and the document's JSON form;
- `_document`: the manifest a write records (`build_manifest`), and `_source_layout` its on-disk layout record;
- `_validate`: every key, type and range checked before anything uses them (`validate_manifest`);
- `_entries` and `_parsed`: the typed view (`Manifest`, `read_manifest`) and the check of a header against it;
- `_members`: plain file names, and the copied non-weight files checked through the folder's store;
- `_coverage`: whether the chunks put every element somewhere exactly once.

Its interface is `__all__`, imported from the package (`from reshard.manifest import X`); its modules are private
(`_name.py`) and used inside `manifest` only.
"""

from ._coverage import coverage_problem, coverage_problems, region_text
from ._document import build_manifest, different_writes, joined_copies, unknown_identity
from ._entries import ExtrasEntry, FileEntry
from ._format import (DCP_SHARDING_INFO_KEY, MANIFEST_NAME, SAVED_OFFSETS_KEY, SHARD_FILE_NAME, dcp_metadata,
                      dump_manifest, extra_file_name, shard_file_name)
from ._members import copied_problems
from ._parsed import Manifest, claimed_names, header_problems, read_manifest, write_label
from ._source_layout import tied_from_record

__all__ = [
    "DCP_SHARDING_INFO_KEY", "ExtrasEntry", "FileEntry", "MANIFEST_NAME", "Manifest", "SAVED_OFFSETS_KEY",
    "SHARD_FILE_NAME", "build_manifest", "claimed_names", "copied_problems", "coverage_problem", "coverage_problems",
    "dcp_metadata", "different_writes", "dump_manifest", "extra_file_name", "header_problems", "joined_copies",
    "read_manifest", "region_text", "shard_file_name", "tied_from_record", "unknown_identity", "write_label",
]
