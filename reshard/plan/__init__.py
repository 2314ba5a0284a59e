"""Plan: the model's tensors, the mesh, where each tensor's chunks go (stock and balanced), and which chunks
each output file holds. Pure: no torch, no I/O.

Its modules are what it exports (`__all__`); their names are used through them, e.g. `reshard.plan.dtypes`.
"""

__all__ = ["dtypes", "files", "layout", "mesh", "placement", "ranks", "report"]
