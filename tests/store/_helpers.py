"""Shared helpers for the host-store tests."""

from __future__ import annotations

from jax_kvoffload.store import HostStore, make_offload_key


def K(i: int, group: int = 0) -> bytes:
    """Key of test block ``i`` (vLLM's tests: ``make_offload_key(str(i), group)``)."""
    return make_offload_key(str(i).encode(), group)


def Ks(*ids: int) -> list[bytes]:
    """Keys of test blocks ``ids``, in order."""
    return [K(i) for i in ids]


def make_store(num_chunks: int = 4, policy: str = "lru", **kwargs: object) -> HostStore:
    """A store with events on, as in vLLM's manager tests."""
    return HostStore(num_chunks, eviction_policy=policy, enable_events=True, **kwargs)
