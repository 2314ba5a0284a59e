"""Plan: the model's tensors, the mesh, where each tensor's chunks go (stock and balanced), and which chunks
each output file holds. Pure: no torch, no I/O.
"""
