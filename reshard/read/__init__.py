"""Read sources: a checkpoint's headers (local or Hub), quantized pairs as the bf16 tensors they stand for,
folders in the distributed-checkpoint layout, and the map from on-disk keys to the model's tensors.

Its modules are what it exports (`__all__`); their names are used through them, e.g. `reshard.read.cache`.
"""

__all__ = ["cache", "checkpoint", "content", "converter_ops", "dcp_source", "experts", "hub", "joined", "key_templates",
           "quant", "range_file", "remote", "safetensors_header", "source", "store"]
