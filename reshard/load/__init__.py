"""Load: the loader patch and `reshard.from_pretrained`, the ranks' agreement to load, the DCP storage reader,
own-file reads, and meta-only materialization.

Its modules are what it exports (`__all__`); their names are used through them, e.g. `reshard.load.agreement`.
"""

__all__ = ["agreement", "chunk_map", "hooks", "loader", "local_read", "materialize", "patch", "progress",
           "replacement", "shard_placement", "storage"]
