"""Write: the files, atomically (one process, worker processes, or a torchrun job), and `merge` back to the
Hugging Face layout.
"""
