"""Read sources: a checkpoint's headers (local or Hub), quantized pairs as the bf16 tensors they stand for,
folders in the distributed-checkpoint layout, and the map from on-disk keys to the model's tensors.
"""
