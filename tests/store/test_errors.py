"""Bad input to every public entry of the store raises a typed error of the library root.

Each case is a wrong type or value a user could pass; the error must be a
`KVOffloadTypeError` / `KVOffloadValueError` (or, for an unimportable policy module,
`PolicyImportError`, an `ImportError`) whose message names the parameter and shows the
value, never a bare AttributeError / IndexError / KeyError from inside, and the store
must be unchanged afterwards.
"""

from __future__ import annotations

import re

import pytest

from jax_kvoffload.errors import KVOffloadError, KVOffloadTypeError, KVOffloadValueError
from jax_kvoffload.store import (
    HostStore,
    PolicyImportError,
    RequestContext,
    cpu_tier_capacity,
    get_offload_group_idx,
    get_policy_class,
    make_offload_key,
    register_policy,
)

from ._helpers import K, Ks

T, V = KVOffloadTypeError, KVOffloadValueError


def _store() -> HostStore:
    m = HostStore(4, enable_events=True)
    ctx = RequestContext("r")
    m.prepare_store(Ks(1, 2), ctx)
    m.complete_store(Ks(1, 2), ctx=ctx)
    return m


BAD_CALLS = [
    # (call, error family, text the message must contain)
    (lambda m: m.lookup(["not", "a", "key"]), T, "list"),
    (lambda m: m.lookup("k"), T, "'k'"),
    (lambda m: m.lookup(7), T, "int"),
    (lambda m: m.prepare_load(None), T, "None"),
    (lambda m: m.prepare_load(K(1)), T, "single bytes"),
    (lambda m: m.prepare_load([K(1), 5]), T, "int: 5"),
    (lambda m: m.prepare_load([b"ab"]), V, "b'ab'"),
    (lambda m: m.prepare_load(Ks(1), "ctx"), T, "ctx must be"),
    (lambda m: m.prepare_load(Ks(1), 3), T, "ctx must be"),
    (lambda m: m.complete_load(5), T, "keys must be"),
    (lambda m: m.complete_load(Ks(1), object()), T, "ctx must be"),
    (lambda m: m.prepare_store([None]), T, "NoneType"),
    (lambda m: m.prepare_store(Ks(3), ctx=["r"]), T, "ctx must be"),
    (lambda m: m.complete_store(Ks(1), "yes"), T, "success must be a bool"),
    (lambda m: m.complete_store(Ks(1), True, 5), T, "ctx must be"),
    (lambda m: m.touch(b"key-0000"), T, "single bytes"),
    (lambda m: m.touch(Ks(1), "ctx"), T, "ctx must be"),
    (lambda m: m.on_new_request(None), T, "on_new_request(ctx) needs"),
    (lambda m: m.on_new_request("r"), T, "ctx must be"),
    (lambda m: m.on_request_finished(None), T, "on_request_finished(ctx) needs"),
    (lambda m: m.take_events(make_event=5), T, "make_event must be callable"),
]


@pytest.mark.parametrize(("call", "family", "text"), BAD_CALLS)
def test_bad_calls_raise_typed_errors_and_change_nothing(call, family, text):
    m = _store()
    m.take_events()
    before = (m.num_free_chunks, m.num_evictable_chunks, m.num_write_pending_chunks)
    with pytest.raises(family, match=re.escape(text)) as info:
        call(m)
    assert isinstance(info.value, KVOffloadError)
    assert (m.num_free_chunks, m.num_evictable_chunks, m.num_write_pending_chunks) == before
    assert m.prepare_load(Ks(1, 2)) == (0, 1)  # still intact


@pytest.mark.parametrize(
    ("kwargs", "family", "text"),
    [
        ({"num_chunks": -1}, V, "num_chunks=-1"),
        ({"num_chunks": "4"}, T, "num_chunks must be an int"),
        ({"num_chunks": 4.0}, T, "num_chunks must be an int"),
        ({"num_chunks": True}, T, "num_chunks must be an int"),
        ({"num_chunks": 4, "eviction_policy": 3}, T, "eviction_policy must be a str"),
        ({"num_chunks": 4, "eviction_policy": "nope"}, V, "Unknown cache policy: 'nope'"),
        ({"num_chunks": 4, "store_threshold": -2}, V, "store_threshold=-2"),
        ({"num_chunks": 4, "max_tracker_size": None}, T, "max_tracker_size"),
        ({"num_chunks": 4, "enable_events": "on"}, T, "enable_events"),
        (
            {"num_chunks": 4, "eviction_policy": "X", "cache_policy_module_path": 5},
            T,
            "cache_policy_module_path must be a str",
        ),
        (
            {"num_chunks": 4, "eviction_policy": "Nope", "cache_policy_module_path": __name__},
            V,
            "has no class named 'Nope'",
        ),
    ],
)
def test_bad_construction_raises_typed_errors(kwargs, family, text):
    num_chunks = kwargs.pop("num_chunks")
    with pytest.raises(family, match=re.escape(text)):
        HostStore(num_chunks, **kwargs)


def test_an_unimportable_policy_module_is_an_import_error_of_ours():
    with pytest.raises(PolicyImportError, match="no_such_module_xyz") as info:
        HostStore(4, eviction_policy="X", cache_policy_module_path="no_such_module_xyz")
    assert isinstance(info.value, ImportError) and isinstance(info.value, KVOffloadError)


@pytest.mark.parametrize(
    ("call", "family", "text"),
    [
        (lambda: RequestContext(5), T, "req_id must be a str"),
        (lambda: RequestContext("r").set_key_position("k", 16), T, "key must be bytes"),
        (lambda: RequestContext("r").set_key_position(K(1), 1.5), T, "end_position"),
        (lambda: RequestContext("r").set_key_position(K(1), -16), V, "end_position=-16"),
        (lambda: make_offload_key("abc", 0), T, "block_hash must be bytes"),
        (lambda: make_offload_key(b"abc", 2**32), V, "group_idx=4294967296"),
        (lambda: make_offload_key(b"abc", "0"), T, "group_idx must be an int"),
        (lambda: get_offload_group_idx(b"ab"), V, "has 2 bytes"),
        (lambda: get_offload_group_idx(5), T, "key must be bytes"),
        (lambda: get_policy_class(None), T, "eviction_policy must be a str"),
        (lambda: register_policy(5, HostStore), T, "name must be a str"),
        (lambda: register_policy("x", HostStore), T, "subclass of AbstractEvictionPolicy"),
        (
            lambda: cpu_tier_capacity([1], worker_kv_bytes_per_block=1, blocks_per_chunk=1),
            T,
            "list",
        ),
        (
            lambda: cpu_tier_capacity(10, worker_kv_bytes_per_block="1", blocks_per_chunk=1),
            T,
            "worker_kv_bytes_per_block",
        ),
        (
            lambda: cpu_tier_capacity(
                10, worker_kv_bytes_per_block=1, blocks_per_chunk=1, replicated_layout=1
            ),
            T,
            "replicated_layout",
        ),
        (
            lambda: cpu_tier_capacity("ten", worker_kv_bytes_per_block=1, blocks_per_chunk=1),
            V,
            "ten",
        ),
    ],
)
def test_helpers_raise_typed_errors(call, family, text):
    with pytest.raises(family, match=re.escape(text)) as info:
        call()
    assert isinstance(info.value, KVOffloadError)
