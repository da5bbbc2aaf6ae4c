"""Typed errors raised by the public block gather / scatter API.

Every error is a ``PallasKernelsError`` (catch it for anything this package raises on
bad input) and a ``ValueError`` or ``TypeError`` subclass, so callers may also catch the
broad builtin. The message names the parameter, states the rule, shows what was received
and, where it can be computed, gives the fix. ``pallas_kernels`` is standalone: these do
not derive from ``jax_kvoffload``'s error root.
"""

from __future__ import annotations


class PallasKernelsError(Exception):
    """Root of the errors ``pallas_kernels`` raises for bad input."""


class BlockIdsError(PallasKernelsError, ValueError):
    """``block_ids`` broke a rule on its values or shape."""


class BlockIdsOutOfRangeError(BlockIdsError):
    """An id is negative or not below the cache's ``num_blocks``; never clamped."""


class DuplicateBlockIdsError(BlockIdsError):
    """``scatter_blocks`` got the same destination id twice (the result would race)."""


class BlockIdsDtypeError(PallasKernelsError, TypeError):
    """``block_ids`` is not an int32 array."""


class CacheError(PallasKernelsError, ValueError):
    """``caches`` as a whole is unusable: empty, deleted (donated), or spread over
    devices that do not match."""


class LayerMismatchError(CacheError):
    """The arrays in ``caches`` differ in shape, dtype or placement."""


class LayoutError(PallasKernelsError, ValueError):
    """A ``KVLayout`` that cannot exist (e.g. MLA pages with K/V stacking)."""


class LayoutMismatchError(LayoutError):
    """A cache's rank or shape does not fit the declared ``layout``."""


class UnsupportedDtypeError(PallasKernelsError, TypeError):
    """A cache dtype the word-moving kernels cannot view as whole integer words."""


class StagingMismatchError(PallasKernelsError, ValueError):
    """``staging`` does not have the shape, dtype or placement ``gather_blocks`` gives."""


class BackendUnavailableError(PallasKernelsError, ValueError):
    """The requested backend is unknown, its Pallas module did not import, or it does
    not run on the caches' platform (the message names what does)."""


class BackendConfigError(PallasKernelsError, ValueError):
    """A backend config field has a value the kernels cannot use."""
