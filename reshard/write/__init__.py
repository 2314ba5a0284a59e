"""Write: the files, atomically (one process, worker processes, or a torchrun job; into a folder, or a bucket prefix
from one process), and `merge` back to the Hugging Face layout.

Its modules are what it exports (`__all__`); their names are used through them, e.g. `reshard.write.distributed`.
"""

__all__ = ["bucket", "distributed", "durable", "files", "lock", "merge", "merge_index", "nodes", "output", "peers",
           "ranks", "runner", "shards", "spread", "staged", "workers"]
