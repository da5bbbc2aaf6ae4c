"""The Mooncake tier on a private Mooncake Store: its configuration (Mooncake's names,
typed errors), its key format, zero-copy rows (a large exporter registered once), the
kinds of damage a value can carry, and the typed error when Mooncake is absent.

The contract suite (`test_contract.py`) runs on the same kind of store; the failures of
the store itself are in `test_mooncake_failures.py`.
"""

from __future__ import annotations

import mmap
import re
import secrets
import sys
import time

import numpy as np
import pytest

from jax_kvoffload.config import MooncakeTierConfig, TierConfigError, parse_secondary_tiers
from jax_kvoffload.tiers import MooncakeTier, TierBufferSizeError, TierStateError
from jax_kvoffload.tiers import _mooncake_client as mc
from jax_kvoffload.tiers._crc import crc32c
from jax_kvoffload.tiers._entry import encode_header, header_length

from ._helpers import free_port, key, payload
from ._mooncake import NO_MOONCAKE, MooncakeStore

NS = bytes(range(32))
N = 8192
OK = {
    "master_server_address": "127.0.0.1:50051",
    "metadata_server": "http://127.0.0.1:8080/metadata",
    "local_hostname": "127.0.0.1",
}

BAD = {
    "no port": ({"master_server_address": "10.0.0.5"}, "host:port"),
    "port 0": ({"master_server_address": "h:0"}, "1..65535"),
    "bad host": ({"master_server_address": "a..b:1"}, "resolver"),
    "metadata scheme": ({"metadata_server": "ftp://h:1/m"}, "metadata server"),
    "metadata no port": ({"metadata_server": "http://h/metadata"}, "metadata server"),
    # urlsplit drops the newline (so it parsed); Mooncake's client would have sent it:
    "metadata newline": ({"metadata_server": "http://h:1/metadata\n"}, "metadata server"),
    "metadata space": ({"metadata_server": "http://h:1/meta data"}, "metadata server"),
    "protocol": ({"protocol": "udp"}, '"tcp" or "rdma"'),
    "rdma without device": ({"device_name": None, "protocol": "rdma"}, "needs the device"),
    "device with tcp": ({"device_name": "mlx5_0"}, 'protocol is "tcp"'),
    "device name": ({"device_name": "mlx5 0", "protocol": "rdma"}, "RDMA device names"),
    "segment size": ({"global_segment_size": "lots"}, "number of bytes"),
    "replicas": ({"replica_num": 0}, r"\[1, 8\]"),
    "threads": ({"read_threads": 10**6}, r"\[1, 256\]"),
    "retry": ({"retry_after_s": float("nan")}, "finite number of seconds"),
    "prefix": ({"key_prefix": "a b"}, "without spaces"),
    "prefix length": ({"key_prefix": "p" * 129}, r"1\.\.128"),  # 1 MB was taken
    "hostname": ({"local_hostname": ""}, "must be a host"),
    # The IDNA check let these through (Mooncake registered or dialled them verbatim):
    "hostname space": ({"local_hostname": "a b"}, "IP address or a host name"),
    "hostname user": ({"local_hostname": "u@h"}, "IP address or a host name"),
    "hostname dash": ({"local_hostname": "-rf"}, "IP address or a host name"),
    "master user": ({"master_server_address": "u@h:50051"}, "IP address or a host name"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_option_is_a_typed_error_naming_key_and_fix(name):
    change, words = BAD[name]
    with pytest.raises(TierConfigError, match=words) as e:
        MooncakeTierConfig(**{**OK, **change})
    assert e.value.key == next(iter(change))
    with pytest.raises(TierConfigError, match=r"secondary_tiers\[0\]"):
        parse_secondary_tiers([{"type": "mooncake", **OK, **change}])


def test_the_options_are_parsed_once_in_mooncakes_names():
    (cfg,) = parse_secondary_tiers(
        [
            {
                "type": "mooncake",
                **OK,
                "protocol": "RDMA",
                "device_name": "mlx5_0,mlx5_1",
                "global_segment_size": "4GiB",
                "local_buffer_size": "16MiB",
            }
        ]
    )
    assert (cfg.protocol, cfg.global_segment_size, cfg.local_buffer_size) == (
        "rdma", 4 << 30, 16 << 20)  # fmt: skip
    assert cfg.master_address == ("127.0.0.1", 50051)
    assert cfg.to_vllm_dict()["type"] == "JaxMooncakeTier"
    assert parse_secondary_tiers([cfg.to_vllm_dict()]) == (cfg,)
    with pytest.raises(
        TierConfigError,
        match=re.escape('master_server_address: is required, e.g. "10.0.0.5:50051"'),
    ):
        parse_secondary_tiers([{"type": "mooncake", "metadata_server": "P2PHANDSHAKE"}])


def test_without_mooncake_opening_says_which_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # import mooncake raises
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(mc.MooncakeUnavailableError, match="pip install 'mooncake-transfer"):
        MooncakeTier(MooncakeTierConfig(**OK), NS)
    assert issubclass(mc.MooncakeUnavailableError, TierStateError)


needs_mooncake = pytest.mark.skipif(NO_MOONCAKE is not None, reason=str(NO_MOONCAKE))


@needs_mooncake
def test_no_master_is_a_typed_error_at_once():
    port = free_port()  # nothing listens there
    cfg = MooncakeTierConfig(**{**OK, "master_server_address": f"127.0.0.1:{port}"},
                             connect_timeout_s=0.5)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(mc.MooncakeUnavailableError, match=f"nothing answers at 127.0.0.1:{port}"):
        MooncakeTier(cfg, NS)
    assert time.monotonic() - t0 < 5  # Mooncake's own setup would wait 90 s


@pytest.fixture(scope="module")
def store():
    if NO_MOONCAKE is not None:
        pytest.skip(NO_MOONCAKE)
    s = MooncakeStore()
    yield s
    s.stop()


@pytest.fixture
def tier(store):
    cfg = MooncakeTierConfig(**store.options(), read_threads=2, write_threads=1)
    t = MooncakeTier(cfg, secrets.token_bytes(32))  # each test its own namespace
    yield t
    t.close()


def _load(tier, ids, n=N):
    outs = [np.full(n, 0xAA, np.uint8) for _ in ids]
    r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs, strict=True)]).result(30)
    for i, o, ok in zip(ids, outs, r.ok, strict=True):
        if ok:
            np.testing.assert_array_equal(o, payload(key(i), n))
    return list(r.ok)


def test_the_key_names_prefix_namespace_hash_and_group(tier):
    ns = tier.namespace[:8].hex()
    assert tier.key_of(key(1, group=3)) == f"jkv:{ns}:{key(1)[:-4].hex()}:3"
    assert tier.key_of(b"\x01\x00\x00\x00\x02") == f"jkv:{ns}:01:2"


def test_rows_of_a_large_exporter_move_from_registered_memory(tier, store):
    rows, n = 16, 1 << 20
    pool = mmap.mmap(-1, rows * n)  # a host pool's rows, as build_host_pool maps them
    a = np.frombuffer(pool, np.uint8).reshape(rows, n)
    for i in range(rows):
        a[i] = payload(key(i), n)
    small = payload(key(99), N)  # a caller's own scratch row: not registered
    assert tier.submit_store([(key(i), a[i]) for i in range(8)]).result(30).all_ok
    assert tier.submit_store([(key(i), memoryview(pool)[i * n : (i + 1) * n])
                              for i in range(8, rows)]).result(30).all_ok  # fmt: skip
    assert tier.submit_store([(key(99), small)]).result(30).all_ok
    regions = tier._regions._regions
    assert len(regions) == 1, regions  # the pool, once, whole
    ((root, addr, size),) = regions.values()
    assert root is pool and size == rows * n and addr == a.ctypes.data
    a[:] = 0
    r = tier.submit_load([(key(i), a[i]) for i in range(rows)]).result(30)
    assert r.all_ok and len(regions) == 1
    for i in range(rows):
        np.testing.assert_array_equal(a[i], payload(key(i), n))
    del a, root, regions
    tier.close()  # unregisters the pool and lets it go: no export of it is left
    pool.close()


def _rewrite(store, tier, k, value: bytes):
    raw, mkey = store.raw, tier.key_of(k)
    raw.remove(mkey, True)
    assert raw.put(mkey, value) == 0


DAMAGE = {
    "a header byte": lambda v: v[:20] + bytes([v[20] ^ 1]) + v[21:],
    "the payload's first byte": lambda v: v[:-N] + bytes([v[-N] ^ 1]) + v[-N + 1 :],
    "truncated inside the header": lambda v: v[:30],
    "truncated payload": lambda v: v[:-1],
    "one byte more": lambda v: v + b"\0",
    "foreign bytes of the same length": lambda v: bytes(len(v)),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_value_is_a_counted_miss_and_removed(tier, store, how):
    assert tier.submit_store([(key(1), payload(key(1), N)), (key(2), payload(key(2), N))]
                             ).result(30).all_ok  # fmt: skip
    value = store.raw.get(tier.key_of(key(1)))
    assert len(value) == header_length(len(key(1))) + N
    _rewrite(store, tier, key(1), DAMAGE[how](value))
    assert _load(tier, [1, 2]) == [False, True]  # never the damaged bytes
    assert tier.stats().corrupt == 1
    assert tier.contains([key(1)]) == [False]  # removed
    assert tier.submit_store([(key(1), payload(key(1), N))]).result(30).all_ok
    assert _load(tier, [1]) == [True]


def test_a_whole_entry_with_a_padded_header_is_a_miss_not_a_buffer_size_error(tier, store):
    # A header padded past its length (valid for the format: the disk tier aligns it)
    # with a payload of the right length: the load raised TierBufferSizeError ("a
    # buffer of N bytes, the entry holds N"), failing the whole job, not one miss.
    assert tier.submit_store([(key(1), payload(key(1), N)), (key(2), payload(key(2), N))]
                             ).result(30).all_ok  # fmt: skip
    body = payload(key(1), N)
    head = encode_header(tier.namespace, key(1), N, crc32c(body), align=4096)
    _rewrite(store, tier, key(1), head + body.tobytes())
    assert _load(tier, [1, 2]) == [False, True]
    assert tier.stats().corrupt == 1


def test_an_entry_of_another_length_is_kept_and_the_load_raises(tier):
    assert tier.submit_store([(key(5), payload(key(5), 2 * N))]).result(30).all_ok
    with pytest.raises(TierBufferSizeError, match=f"payload of {2 * N} bytes") as e:
        tier.submit_load([(key(5), np.zeros(N, np.uint8)), (key(6), np.zeros(N, np.uint8))]
                         ).result(30)  # fmt: skip
    assert e.value.result.ok == (False, False)
    assert tier.contains([key(5)]) == [True] and tier.stats().corrupt == 0
    assert _load(tier, [5], 2 * N) == [True]


def test_rows_outside_registered_memory_are_staged_where_the_transport_needs_it(tier, store):
    # RDMA moves registered memory only: rows elsewhere go through the thread's
    # registered scratch. Forced on this TCP tier (no RDMA device here), the same path.
    tier._rdma = True
    for s in tier._scratch:
        s._register = True
    assert tier.submit_store([(key(i), payload(key(i), N)) for i in range(6)]).result(30).all_ok
    assert tier._regions._regions == {}  # small rows: staged, not registered
    assert _load(tier, range(6)) == [True] * 6  # staged back, byte for byte
    value = store.raw.get(tier.key_of(key(3)))
    _rewrite(store, tier, key(3), DAMAGE["the payload's first byte"](value))
    assert _load(tier, [3, 4]) == [False, True] and tier.stats().corrupt == 1


def test_ever_new_large_buffers_are_not_all_kept(tier, monkeypatch):
    monkeypatch.setattr(mc, "MAX_AUTO_REGIONS", 2)
    for i in range(4):  # a caller's fresh 4 MiB buffer per job
        big = np.zeros(4 << 20, np.uint8)
        big[:N] = payload(key(i), N)
        assert tier.submit_store([(key(i), big[:N])]).result(30).all_ok
    assert len(tier._regions._regions) == 2  # the first two; the rest move unregistered
    assert _load(tier, range(4)) == [True] * 4
