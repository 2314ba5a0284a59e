"""Prove a written folder complete and exact: manifest vs files, coverage, empty markers, and bytes vs source.

This proves the copying, not reshard's key mapping (which on-disk keys make which in-memory tensor): the bytes are
compared with the source bytes that mapping names. The tests check the mapping against transformers' own load.
Every file is read through its folder's store (`reshard.read._store`), so a folder in S3 is checked the same way.

Its interface is `__all__`, imported from the package (`from reshard.verification import X`); its modules are private
(`_name.py`) and used inside `verification` only.
"""

from ._common import reworded
from ._folder import check_folder

__all__ = [
    "check_folder", "reworded",
]
