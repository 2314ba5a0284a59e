"""Load: the loader patch and `reshard.from_pretrained`, the ranks' agreement to load, the DCP storage reader,
own-file reads, and meta-only materialization.
"""
