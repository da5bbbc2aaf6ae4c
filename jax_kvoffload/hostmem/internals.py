"""The hostmem package's parts shared with the rest of this library: semi-public.

The transfer engine and the offloader check ids with the same helpers the pools use,
and the canonical relayout (`transfer`) copies rows with the same strided copies; they
import them from here so that no package of ours reaches into another's private
`_modules`. Stable within a release; not user API.
"""

from jax_kvoffload.hostmem._indices import check_index as check_index
from jax_kvoffload.hostmem._indices import check_indices as check_indices
from jax_kvoffload.hostmem._strided import StridedCopy as StridedCopy
from jax_kvoffload.hostmem._strided import copy_rows as copy_rows
from jax_kvoffload.hostmem._strided import copy_threads as copy_threads
from jax_kvoffload.hostmem._strided import merge_copies as merge_copies

__all__ = [
    "StridedCopy",
    "check_index",
    "check_indices",
    "copy_rows",
    "copy_threads",
    "merge_copies",
]
