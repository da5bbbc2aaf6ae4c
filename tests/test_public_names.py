"""No two public classes share one name: a class name exported by two of the library's
packages is one class (one concept, one name), re-exported where users look for it."""

from __future__ import annotations

import importlib
import inspect

PACKAGES = (
    "jax_kvoffload",
    "jax_kvoffload.config",
    "jax_kvoffload.errors",
    "jax_kvoffload.stats",
    "jax_kvoffload.store",
    "jax_kvoffload.tiers",
    "jax_kvoffload.transfer",
    "jax_kvoffload.hostmem",
    "jax_kvoffload.offloader",
    "jax_kvoffload.assembly",
    "jax_kvoffload.config.internals",
    "jax_kvoffload.store.internals",
    "jax_kvoffload.transfer.internals",
    "jax_kvoffload.hostmem.internals",
)


def public_classes() -> dict[str, set[type]]:
    out: dict[str, set[type]] = {}
    for name in PACKAGES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if inspect.isclass(obj):
                out.setdefault(attr, set()).add(obj)
    return out


def test_a_public_class_name_is_one_class():
    twice = {
        name: sorted(f"{c.__module__}.{c.__qualname__}" for c in classes)
        for name, classes in public_classes().items()
        if len(classes) > 1
    }
    assert twice == {}


def test_medium_is_one_enum_for_events_and_transfer_paths():
    from jax_kvoffload import store, transfer

    assert store.Medium is transfer.Medium
    medium = store.Medium
    assert [m.value for m in medium] == ["device", "host", "disk", "remote"]
    assert medium.CPU is medium.HOST  # vLLM's name for the host tier
    assert store.OffloadingEvent((b"k",)).medium is medium.CPU
    assert str(transfer.TransferPath(medium.HOST, medium("disk"))) == "host->disk"
