"""Write: the files, atomically (one process, worker processes, or a torchrun job; into a folder, or a bucket prefix
from one process), and `merge` back to the Hugging Face layout.

Its interface is `__all__`, imported from the package (`from reshard.write import X`); its modules are private
(`_name.py`) and used inside `write` only.
"""

from ._merge import DEFAULT_MAX_SHARD_SIZE, left_out, merge_job
from ._merge_index import MergeIndex
from ._peers import Listing
from ._runner import run_job
from ._shards import WriteJob
from ._staged import check_url_output, refuse_empty_output

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "Listing", "MergeIndex", "WriteJob", "check_url_output", "left_out", "merge_job",
    "refuse_empty_output", "run_job",
]
