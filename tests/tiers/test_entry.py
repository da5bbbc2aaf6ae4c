"""The entry format, the namespace digest and CRC32C.

Every byte of a header is flipped in turn and must be caught; namespace digests must
differ for every field that changes the meaning of the bytes and agree where vLLM's rule
says the bytes are portable; every CRC32C backend must agree with the textbook loop.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from jax_kvoffload.tiers import _crc
from jax_kvoffload.tiers._entry import (
    ENTRY_MAGIC,
    check_header,
    encode_header,
    header_length,
    namespace_digest,
    namespace_fields,
)

from ._helpers import key, offloading_config

NS = bytes(range(32))


@pytest.mark.parametrize("align", [1, 4096])
def test_header_round_trip(align):
    k = key(1)
    h = encode_header(NS, k, 12345, 0xDEADBEEF, align=align)
    assert len(h) == header_length(len(k), align) and h.startswith(ENTRY_MAGIC)
    got = check_header(h, namespace=NS, key=k, payload_len=12345)
    assert (got.namespace, got.key, got.payload_len, got.payload_crc, got.header_len) == (
        NS,
        k,
        12345,
        0xDEADBEEF,
        len(h),
    )


def test_every_flipped_header_byte_is_caught():
    k = key(2)
    h = bytearray(encode_header(NS, k, 99, 7))
    for i in range(len(h)):
        for bit in (0x01, 0x80):
            bad = bytearray(h)
            bad[i] ^= bit
            assert isinstance(check_header(bad, namespace=NS, key=k, payload_len=99), str), i


@pytest.mark.parametrize(
    ("namespace", "k", "plen", "reason"),
    [
        (bytes(32), key(3), 10, "namespace mismatch"),
        (NS, key(4), 10, "key mismatch"),
        (NS, key(3), 11, "payload length 10 != expected 11"),
        (NS, key(3)[:-1], 10, "key length mismatch"),
    ],
)
def test_a_header_for_something_else_is_refused(namespace, k, plen, reason):
    h = encode_header(NS, key(3), 10, 0)
    assert check_header(h, namespace=namespace, key=k, payload_len=plen) == reason


def test_truncated_headers_are_reasons_not_exceptions():
    k = key(5)
    h = encode_header(NS, k, 1, 1)
    for n in range(len(h)):
        assert isinstance(check_header(h[:n], namespace=NS, key=k), str)


def test_namespace_depends_on_what_the_bytes_mean():
    base = namespace_digest(offloading_config())
    changed = [
        offloading_config(model="other"),
        offloading_config(dtype="float16"),
        offloading_config(layout="LBHNC"),
        offloading_config(bpc=2),
        offloading_config(tp=2),
        offloading_config(canonical=True, agnostic=True),
        offloading_config(replicated=True),
    ]
    digests = {namespace_digest(c) for c in changed}
    assert base not in digests and len(digests) == len(changed)
    assert namespace_digest(offloading_config(), rank=0) != base
    assert namespace_digest(offloading_config(), rank=0) != namespace_digest(
        offloading_config(), rank=1
    )
    # Groups: another layer list is another geometry.
    cfg = offloading_config()
    g = dataclasses.replace(cfg.groups[0], layer_names=("l0",))
    assert namespace_digest(dataclasses.replace(cfg, groups=(g,))) != base


def test_portable_bytes_share_a_namespace_across_tensor_parallel_sizes():
    # vLLM's FileMapper rule: parallelism-agnostic bytes drop the topology.
    tp1 = offloading_config(tp=1, canonical=True, agnostic=True)
    tp4 = offloading_config(tp=4, canonical=True, agnostic=True)
    assert namespace_digest(tp1) == namespace_digest(tp4)
    assert namespace_fields(tp1)["canonical_format"] == "v1-nhd"
    assert "topology" not in namespace_fields(tp1)
    # Not agnostic: the topology is part of the namespace.
    assert namespace_digest(offloading_config(tp=1)) != namespace_digest(offloading_config(tp=4))
    with pytest.raises(ValueError, match="codec"):
        namespace_digest(tp1, codec="zstd")
    with pytest.raises(ValueError, match="rank"):
        namespace_digest(tp1, rank=-1)


def test_namespace_digest_is_stable():
    # Changing the digest orphans every stored entry: this value is part of the format.
    assert namespace_digest(offloading_config()).hex()[:16] == "e9d0a3e732ef1a0b"


@pytest.mark.parametrize("n", [0, 1, 7, 8, 255, 256, 257, 4095, 4097, 65536 + 3, 300_001])
def test_crc32c_backends_agree_with_the_textbook_loop(n):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    seed = int(rng.integers(0, 2**32))
    want = _crc.crc32c_reference(data, seed) if n < 70_000 else None
    got = _crc.crc32c_numpy(data, seed)
    if want is not None:
        assert got == want
    assert _crc.crc32c(data, seed) == got
    assert _crc.crc32c(memoryview(bytearray(data)), seed) == got
    if importlib.util.find_spec("google_crc32c"):
        import google_crc32c

        assert google_crc32c.extend(seed, data) == got


def test_crc32c_check_value_and_chaining():
    # RFC 3720's check value; chaining equals one pass over the concatenation.
    assert _crc.crc32c(b"123456789") == _crc.crc32c_numpy(b"123456789") == 0xE3069283
    a, b = b"x" * 1000, b"y" * 3000
    assert _crc.crc32c(b, _crc.crc32c(a)) == _crc.crc32c(a + b)
    assert _crc.CRC32C_BACKEND in ("google_crc32c", "crc32c", "numpy")
