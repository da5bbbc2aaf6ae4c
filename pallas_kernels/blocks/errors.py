"""Typed errors raised by the public block gather / scatter API.

Every error is a ``ValueError`` or ``TypeError`` subclass so callers may catch the broad
builtin; the message names the parameter, states the rule, shows what was received and,
where it can be computed, gives the fix.
"""

from __future__ import annotations


class BlockIdsError(ValueError):
    """``block_ids`` broke a rule on its values or shape."""


class BlockIdsOutOfRangeError(BlockIdsError):
    """An id is negative or not below the cache's ``num_blocks``; never clamped."""


class DuplicateBlockIdsError(BlockIdsError):
    """``scatter_blocks`` got the same destination id twice (the result would race)."""


class BlockIdsDtypeError(TypeError):
    """``block_ids`` is not an int32 array."""


class LayerMismatchError(ValueError):
    """The arrays in ``caches`` differ in shape or dtype."""


class LayoutMismatchError(ValueError):
    """A cache's rank or shape does not fit the declared ``layout``."""


class UnsupportedDtypeError(TypeError):
    """A cache dtype the word-moving kernels cannot view as whole integer words."""


class StagingMismatchError(ValueError):
    """``staging`` does not have the shape or dtype ``gather_blocks`` would produce."""


class BackendUnavailableError(ValueError):
    """The requested backend is unknown, or its Pallas module did not import."""
