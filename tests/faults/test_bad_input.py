"""Bad input at every public entry (issue 12, defects 8 and 9).

Caches that contradict the config are refused when the offloader is built; every bad
argument of KVOffloader, TransferEngine, GroupCaches and HostChunkPool raises an error
of the library's root (`KVOffloadTypeError` for a wrong type, `KVOffloadValueError`
for a wrong value, `KVOffloadStateError` for a wrong state) whose message names the
argument; nothing is truncated (a float block id is refused) and a refused call
changes nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from jax_kvoffload.errors import (
    KVOffloadError,
    KVOffloadStateError,
    KVOffloadTypeError,
    KVOffloadValueError,
)
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.store import StoreError
from jax_kvoffload.transfer import GroupTransfer, TransferEngine
from tests.faults._helpers import NB, config, hashes, noise, offloader, pins, write_blocks

KIND = {"type": KVOffloadTypeError, "value": KVOffloadValueError, "state": KVOffloadStateError}
# The store's errors (key not stored, ...) join the root in the store's own change.
STORE_ERRORS = () if issubclass(StoreError, KVOffloadError) else (StoreError,)


def nhd(arrays) -> GroupCaches:
    return GroupCaches(arrays, pk.KVLayout.nhd())


def refused(kind: str, fn, match: str | None = None):
    with pytest.raises(KVOffloadError) as info:
        fn()
    assert isinstance(info.value, KIND[kind]), (type(info.value).__mro__, info.value)
    assert str(info.value)
    if match:
        assert match in str(info.value), str(info.value)
    return info.value


CACHE_CASES = {
    # name: (kind, caches builder, text the message must contain)
    "a plain list": ("type", lambda: noise(), "GroupCaches"),
    "a dict of lists": ("type", lambda: {0: noise()}, "GroupCaches"),
    "three layers for two": ("value", lambda: nhd(noise() + noise(1)[:1]), "2 layers"),
    "one layer for two": ("value", lambda: nhd(noise()[:1]), "2 layers"),
    "float32 for float16": (
        "value",
        lambda: nhd([a.astype(jnp.float32) for a in noise()]),
        "dtype",
    ),
    "8 tokens per block for 4": (
        "value",
        lambda: nhd(
            [jnp.zeros((NB, 8, 2, 8), jnp.uint16)] * 1 + [jnp.ones((NB, 8, 2, 8), jnp.uint16)]
        ),
        "tokens per block",
    ),
    "a string group id": ("type", lambda: {"0": nhd(noise())}, "group ids"),
    "an unknown group": ("value", lambda: {0: nhd(noise()), 3: nhd(noise(1))}, "unknown [3]"),
}


@pytest.mark.parametrize("name", sorted(CACHE_CASES))
def test_caches_that_contradict_the_config_are_refused(name):
    kind, build, match = CACHE_CASES[name]
    refused(kind, lambda: KVOffloader(config(), build(), backend="xla"), match)


GROUP_CACHE_CASES = {
    "numpy arrays": ("type", lambda: [np.zeros((NB, 4, 2, 8), np.uint16)] * 2, "jax.device_put"),
    "not a list": ("type", lambda: jnp.zeros((NB, 4, 2, 8)), "list"),
    "empty": ("value", lambda: [], "empty"),
    "rank 3 for NHD": ("value", lambda: [jnp.zeros((NB, 4, 16), jnp.uint16)], "rank"),
    "head sizes differ": (
        "value",
        lambda: [jnp.zeros((NB, 4, 2, 8), jnp.uint16), jnp.zeros((NB, 4, 2, 16), jnp.uint16)],
        "one shape and dtype",
    ),
    "block counts differ": (
        "value",
        lambda: [jnp.zeros((NB, 4, 2, 8), jnp.uint16), jnp.zeros((NB - 1, 4, 2, 8), jnp.uint16)],
        "one shape and dtype",
    ),
    "no blocks": ("value", lambda: [jnp.zeros((0, 4, 2, 8), jnp.uint16)], "no blocks"),
    "the same array twice": ("value", lambda: [noise()[0]] * 2, "same array"),
    "complex dtype": ("type", lambda: [jnp.zeros((NB, 4, 2, 8), jnp.complex64)], "dtype"),
}


@pytest.mark.parametrize("name", sorted(GROUP_CACHE_CASES))
def test_group_caches_refuse_bad_arrays(name):
    kind, build, match = GROUP_CACHE_CASES[name]
    refused(kind, lambda: nhd(build()), match)


def test_group_caches_refuse_a_deleted_array_and_a_bad_layout():
    a = noise()
    a[0].delete()
    refused("state", lambda: nhd(a), "deleted")
    # A layout is a KVLayout or one of its names (pallas_kernels.LAYOUT_NAMES, "rpa" since
    # issue 19); anything else is refused, an unknown name by value.
    refused("type", lambda: GroupCaches(noise(), 3), "KVLayout")
    refused("value", lambda: GroupCaches(noise(), "nhdx"), "nhdx")


def test_the_same_array_in_two_groups_is_refused():
    cfg = config()
    shared = noise()
    with pytest.raises(KVOffloadError):
        KVOffloader(cfg, {0: nhd(shared), 1: nhd(shared)}, backend="xla")


CONSTRUCTOR_CASES = {
    "config None": ("type", dict(config=None), "OffloadingConfig"),
    "budget of 100 bytes": ("value", dict(cpu_bytes_to_use=100), "4096"),
    "budget 'abc'": ("value", dict(cpu_bytes_to_use="abc"), "cpu_bytes_to_use"),
    "budget True": ("type", dict(cpu_bytes_to_use=True), "cpu_bytes_to_use"),
    "budget 1.5": ("type", dict(cpu_bytes_to_use=1.5), "cpu_bytes_to_use"),
    "unknown policy": ("value", dict(eviction_policy="nope"), "nope"),
    "backend 'nope'": ("value", dict(backend="nope"), "backend"),
    "max_bucket 3": ("value", dict(max_bucket=3), "use 2"),
    "max_bucket 4.0": ("type", dict(max_bucket=4.0), "max_bucket"),
}


@pytest.mark.parametrize("name", sorted(CONSTRUCTOR_CASES))
def test_bad_constructor_arguments(name):
    kind, kwargs, match = CONSTRUCTOR_CASES[name]
    kwargs = {"config": config(), "caches": nhd(noise()), "backend": "xla", **kwargs}
    refused(kind, lambda: KVOffloader(**kwargs), match)


def test_canonical_layout_needs_an_int_head_count():
    cfg = config(canonical_layout=True)
    refused("type", lambda: KVOffloader(cfg, nhd(noise()), backend="xla", total_kv_heads="2"))
    refused("value", lambda: KVOffloader(cfg, nhd(noise()), backend="xla"), "total_kv_heads")


H4 = hashes("a", 4)
CALL_CASES = {
    # name: (kind, call on an offloader, text)
    "float block id": ("type", lambda o: o.store(H4[:2], [1.5, 2]), "block_ids[0]"),
    "integral float block id": ("type", lambda o: o.store(H4[:2], [1, 2.0]), "block_ids"),
    "float array of ids": ("type", lambda o: o.store(H4[:2], np.array([1.0, 2.0])), "block_ids"),
    "bool block id": ("type", lambda o: o.store(H4[:2], [True, 2]), "bool"),
    "ids as a string": ("type", lambda o: o.store(H4[:2], "12"), "block_ids"),
    "ids None": ("type", lambda o: o.store(H4[:2], None), "block_ids"),
    "2-D ids": ("value", lambda o: o.store(H4[:2], [[1, 2]]), "1-D"),
    "id out of range": ("value", lambda o: o.store(H4[:2], [1, NB]), f"[0, {NB})"),
    "negative id": ("value", lambda o: o.store(H4[:2], [-1, 2]), f"[0, {NB})"),
    "huge id": ("value", lambda o: o.store(H4[:2], [1, 2**70]), "block_ids"),
    "fewer ids than hashes": ("value", lambda o: o.store(H4[:2], [1]), "one hash per block"),
    "hashes a string": ("type", lambda o: o.store("ab", [1, 2]), "block_hashes"),
    "hash a str": ("type", lambda o: o.store([H4[0], "x"], [1, 2]), "bytes"),
    "hashes None": ("type", lambda o: o.lookup(None), "block_hashes"),
    "group '0'": ("type", lambda o: o.lookup(H4, group="0"), "group"),
    "group [0]": ("type", lambda o: o.lookup(H4, group=[0]), "group"),
    "group 0.0": ("type", lambda o: o.lookup(H4, group=0.0), "group"),
    "group 5": ("value", lambda o: o.lookup(H4, group=5), "not offloaded"),
    "duplicate load ids": ("value", lambda o: o.load(H4[:2], [3, 3]), "unique"),
    "wait(5)": ("type", lambda o: o.wait(5), "job_ids"),
    "wait(['a'])": ("type", lambda o: o.wait(["a"]), "job id"),
    "wait([1.0])": ("type", lambda o: o.wait([1.0]), "job id"),
    "wait unknown": ("value", lambda o: o.wait([12345]), "unknown"),
    "caches(7)": ("value", lambda o: o.caches(7), "not offloaded"),
    "set_caches numpy": (
        "type",
        lambda o: o.set_caches([np.zeros((NB, 4, 2, 8), np.uint16)] * 2),
        "jax.Array",
    ),
    "set_caches other shape": (
        "value",
        lambda o: o.set_caches([jnp.zeros((NB, 4, 2, 4), jnp.uint16) for _ in range(2)]),
        "shapes",
    ),
    "set_caches same array twice": ("value", lambda o: o.set_caches([o.caches()[0]] * 2), "same"),
    "set_caches one array": ("value", lambda o: o.set_caches(o.caches()[:1]), "shapes"),
}


@pytest.mark.parametrize("name", sorted(CALL_CASES))
def test_bad_call_arguments_change_nothing(name):
    kind, call, match = CALL_CASES[name]
    off = offloader()
    write_blocks(off, [1, 2, 3, 4], H4)
    assert off.wait([off.store(H4, [1, 2, 3, 4])])[0].success
    before = [np.asarray(a).copy() for a in off.caches()]
    refused(kind, lambda: call(off), match)
    assert pins(off) == (0, 0)
    assert off.lookup(H4) == 4
    for a, b in zip(off.caches(), before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert off.close() == []


def test_loading_what_is_not_stored_is_refused_with_a_typed_error():
    off = offloader()
    with pytest.raises((KVOffloadError, *STORE_ERRORS)):
        off.load(hashes("never", 2), [1, 2])
    assert pins(off) == (0, 0)
    off.close()


@pytest.mark.parametrize(
    "call",
    ["store", "load", "lookup", "poll", "wait", "reset_cache", "set_caches"],
)
def test_use_after_close_is_a_state_error(call):
    off = offloader()
    arrays = off.caches()
    off.close()
    args = {
        "store": (H4, [1, 2, 3, 4]),
        "load": (H4, [1, 2, 3, 4]),
        "lookup": (H4,),
        "set_caches": (arrays,),
    }.get(call, ())
    refused("state", lambda: getattr(off, call)(*args), "closed")
    assert off.close() == []  # still idempotent
    assert len(off.caches()) == 2  # the arrays stay readable


def engine():
    gc = nhd(noise())
    return TransferEngine({0: gc}, HostChunkPool(4, {0: gc.block_bytes}, 2), backend="xla")


ENGINE_CASES = {
    "job id 1.0": ("type", lambda e: e.submit_store(1.0, [GroupTransfer(0, (1,), (0,))]), "job_id"),
    "transfers not a list": (
        "type",
        lambda e: e.submit_store(1, GroupTransfer(0, (1,), (0,))),
        "list",
    ),
    "transfer a tuple": ("type", lambda e: e.submit_store(1, [(0, (1,), (0,))]), "GroupTransfer"),
    "float block id": (
        "type",
        lambda e: e.submit_store(1, [GroupTransfer(0, (1.5,), (0,))]),
        "block_ids",
    ),
    "float chunk id": (
        "type",
        lambda e: e.submit_load(1, [GroupTransfer(0, (1,), (0.0,))]),
        "chunk_ids",
    ),
    "float first slot": (
        "type",
        lambda e: e.submit_store(1, [GroupTransfer(0, (1,), (0,), 1.0)]),
        "first_slot",
    ),
    "group '0'": ("type", lambda e: e.submit_store(1, [GroupTransfer("0", (1,), (0,))]), "group"),
    "unknown group": (
        "value",
        lambda e: e.submit_store(1, [GroupTransfer(3, (1,), (0,))]),
        "unknown group",
    ),
    "chunk out of range": (
        "value",
        lambda e: e.submit_store(1, [GroupTransfer(0, (1,), (9,))]),
        "outside",
    ),
    "wait('1')": ("type", lambda e: e.wait("1"), "job_ids"),
    "wait([None])": ("type", lambda e: e.wait([None]), "job id"),
    "arrays(7)": ("value", lambda e: e.arrays(7), "unknown group"),
    "arrays('0')": ("type", lambda e: e.arrays("0"), "group"),
    "discard(9)": ("value", lambda e: e.discard(9), "not in flight"),
}


@pytest.mark.parametrize("name", sorted(ENGINE_CASES))
def test_bad_engine_calls(name):
    kind, call, match = ENGINE_CASES[name]
    with engine() as e:
        refused(kind, lambda: call(e), match)
        assert e.get_finished() == [] and e.in_flight == 0


def test_engine_constructor_and_use_after_close():
    gc = nhd(noise())
    pool = HostChunkPool(4, {0: gc.block_bytes}, 2)
    refused("type", lambda: TransferEngine([gc], pool))
    refused("type", lambda: TransferEngine({0: gc}, None))
    refused("value", lambda: TransferEngine({0: gc}, pool, max_bucket=6), "use 4")
    refused("value", lambda: TransferEngine({0: gc}, pool, backend="cuda"), "backend")
    refused(
        "value", lambda: TransferEngine({0: gc}, HostChunkPool(4, {0: 8}, 2)), "bytes per block"
    )
    e = TransferEngine({0: gc}, pool, backend="xla")
    e.close()
    refused("state", lambda: e.submit_store(1, [GroupTransfer(0, (1,), (0,))]), "closed")


POOL_CASES = {
    "num_chunks 1.5": ("type", lambda: HostChunkPool(1.5, {0: 8}, 2), "num_chunks"),
    "num_chunks -1": ("value", lambda: HostChunkPool(-1, {0: 8}, 2), "num_chunks"),
    "widths a list": ("type", lambda: HostChunkPool(4, [8], 2), "bytes_per_block"),
    "width '8'": ("type", lambda: HostChunkPool(4, {0: "8"}, 2), "bytes_per_block"),
    "width -8": ("value", lambda: HostChunkPool(4, {0: -8}, 2), "bytes_per_block"),
    "bpc 0": ("value", lambda: HostChunkPool(4, {0: 8}, 0), "blocks_per_chunk"),
    "chunk 'a'": ("type", lambda: HostChunkPool(4, {0: 8}, 2).check_chunks(["a"]), "chunk_ids"),
    "chunk 1.5": ("type", lambda: HostChunkPool(4, {0: 8}, 2).check_chunks([1.5]), "chunk_ids"),
    "chunk 4": ("value", lambda: HostChunkPool(4, {0: 8}, 2).check_chunks([4]), "outside"),
    "rows([0])": ("type", lambda: HostChunkPool(4, {0: 8}, 2).rows([0]), "group"),
    "rows(3)": ("value", lambda: HostChunkPool(4, {0: 8}, 2).rows(3), "no host rows"),
}


@pytest.mark.parametrize("name", sorted(POOL_CASES))
def test_bad_pool_arguments(name):
    kind, call, match = POOL_CASES[name]
    refused(kind, call, match)
