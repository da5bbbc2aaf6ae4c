"""The contract every secondary tier keeps (`SecondaryTier`'s docstring), as checks that
take a harness: what one kind of tier needs to be opened, damaged and slowed.

`tests/tiers/test_contract.py` runs every check on every registered tier kind, each
through its harness (`HARNESSES`, filled by `@contract_harness(kind)` in
`_contract_harnesses.py`); a kind without a harness fails there. `run_contract(harness)`
runs them all on one harness (CONTRIBUTING.md, "Adding a tier").
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jax_kvoffload.config.internals import tier_config_from_dict
from jax_kvoffload.tiers import (
    SecondaryTier,
    TierBufferSizeError,
    TierClosedError,
    open_tier,
    tier_class,
    tier_kinds,
)

from ._helpers import key, payload

N = 8192  # payload bytes of one entry
CLOSE_S = 10.0  # what "bounded" means here: close() returns well within this


class TierHarness(ABC):
    """How the contract suite drives one kind of tier.

    `start()` makes what the tier lives on (a directory, a server), once for many
    checks; each check opens tiers in a namespace of its own. `stop()` removes it.
    """

    #: The registered kind's name (the `type` of its `secondary_tiers` entries).
    kind: str = ""
    #: Entries outlive the tier object: a tier opened again on the same backing finds them.
    persists: bool = True

    @abstractmethod
    def start(self, tmp_path: str) -> None:
        """Makes the tier's backing (under `tmp_path` if it needs files)."""

    def stop(self) -> None:  # noqa: B027 (a hook: a directory needs no stopping)
        """Removes the backing; every tier opened on it is closed by then."""

    @abstractmethod
    def options(self) -> dict[str, Any]:
        """The keys of this kind's `secondary_tiers` entry, besides `type`."""

    def backpressure_options(self, nbytes: int) -> dict[str, Any]:
        """Options that let at most `nbytes` of stores wait (then new ones are dropped)."""
        return {"max_pending_store_bytes": nbytes}

    @abstractmethod
    def damage(self, tier: SecondaryTier, key: bytes) -> None:
        """Changes one payload byte of the entry `tier` holds under `key`."""

    @abstractmethod
    def stalled_stores(self, tier: SecondaryTier) -> contextlib.AbstractContextManager:
        """Inside the block, the tier's store I/O does not finish (a slow tier); loads
        still do. The stalled stores finish after the block."""

    def open(self, namespace: bytes, **options: Any) -> SecondaryTier:
        """A tier of this kind on the harness's backing, opened through the parser and
        the registry as an engine opens it."""
        entry = {"type": self.kind, **self.options(), **options}
        return open_tier(tier_config_from_dict(entry), namespace)


HARNESSES: dict[str, type[TierHarness]] = {}


def contract_harness(kind: str) -> Callable[[type[TierHarness]], type[TierHarness]]:
    """Registers the decorated harness class as the contract suite's for `kind`."""

    def register(cls: type[TierHarness]) -> type[TierHarness]:
        assert kind not in HARNESSES, f"two harnesses for the tier kind {kind!r}"
        cls.kind = kind
        HARNESSES[kind] = cls
        return cls

    return register


# ---- helpers -----------------------------------------------------------------------------


def fresh_namespace() -> bytes:
    return secrets.token_bytes(32)


def store(tier: SecondaryTier, ids, n: int = N):
    return tier.submit_store([(key(i), payload(key(i), n)) for i in ids]).result(timeout=30)


def load(tier: SecondaryTier, ids, n: int = N) -> list[bool]:
    """Loads `ids`; every hit is checked byte for byte."""
    outs = [np.full(n, 0xAA, np.uint8) for _ in ids]
    r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs, strict=True)]).result(30)
    for i, o, ok in zip(ids, outs, r.ok, strict=True):
        if ok:
            np.testing.assert_array_equal(o, payload(key(i), n), err_msg=f"key {i}")
    return list(r.ok)


@contextlib.contextmanager
def opened(harness: TierHarness, namespace: bytes, **options: Any) -> Iterator[SecondaryTier]:
    tier = harness.open(namespace, **options)
    try:
        yield tier
    finally:
        tier.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- the checks ---------------------------------------------------------------------------


def check_the_kind_is_what_the_registry_says(harness: TierHarness) -> None:
    kind = next(k for k in tier_kinds() if k.name == harness.kind)
    with opened(harness, fresh_namespace()) as tier:
        assert type(tier) is tier_class(kind)
        assert tier.medium in ("disk", "remote"), tier.medium
        assert tier_config_from_dict({"type": kind.name, **harness.options()}).type == kind.name


def check_round_trip(harness: TierHarness) -> None:
    ns = fresh_namespace()
    with opened(harness, ns) as tier:
        assert tier.namespace == ns
        r = store(tier, range(4))
        assert r.all_ok and r.kind == "store" and r.nbytes == 4 * N
        assert tier.contains([key(0), key(3), key(9)]) == [True, True, False]
        assert tier.lookup_async([key(1), key(8)]).result(30) == [True, False]
        assert load(tier, [2, 9, 0]) == [True, False, True]  # a miss is no error
        assert store(tier, [1]).all_ok  # a key that exists: success
        assert load(tier, [1]) == [True]
        s = tier.stats()
        assert (s.load_hits, s.load_misses, s.corrupt) == (3, 1, 0)
        assert s.bytes_read == 3 * N and s.keys_stored >= 5
        assert store(tier, []).all_ok and load(tier, []) == []  # empty jobs complete


def check_a_damaged_entry_is_a_miss_and_counted(harness: TierHarness) -> None:
    with opened(harness, fresh_namespace()) as tier:
        assert store(tier, [1, 2]).all_ok
        harness.damage(tier, key(1))
        assert load(tier, [1, 2]) == [False, True]  # never the damaged bytes
        assert tier.stats().corrupt == 1
        assert tier.contains([key(1)]) == [False]  # removed
        assert load(tier, [1]) == [False] and tier.stats().corrupt == 1  # now just absent
        assert store(tier, [1]).all_ok and load(tier, [1]) == [True]  # stored anew


def check_a_buffer_of_another_length_raises_and_keeps_the_entry(harness: TierHarness) -> None:
    with opened(harness, fresh_namespace()) as tier:
        assert store(tier, [1]).all_ok
        out = np.zeros(N // 2, np.uint8)
        future = tier.submit_load([(key(1), out)])
        try:
            future.result(30)
        except TierBufferSizeError as e:
            assert e.result.ok == (False,)
        else:
            raise AssertionError("a buffer of another length loaded")
        assert tier.contains([key(1)]) == [True] and tier.stats().corrupt == 0
        assert load(tier, [1]) == [True]


def check_namespaces_never_mix(harness: TierHarness) -> None:
    ns_a, ns_b = fresh_namespace(), fresh_namespace()
    with opened(harness, ns_a) as a, opened(harness, ns_b) as b:
        assert store(a, [1, 2]).all_ok
        assert b.contains([key(1), key(2)]) == [False, False]
        assert load(b, [1, 2]) == [False, False]
        other = [(key(1), payload(key(99), N))]  # the same key, other bytes
        assert b.submit_store(other).result(30).all_ok
        out = np.zeros(N, np.uint8)
        assert b.submit_load([(key(1), out)]).result(30).all_ok
        np.testing.assert_array_equal(out, payload(key(99), N))
        assert load(a, [1, 2]) == [True, True]  # a's bytes, untouched by b
        assert a.stats().corrupt == b.stats().corrupt == 0


def check_a_slow_tier_drops_stores_and_says_so(harness: TierHarness) -> None:
    with opened(harness, fresh_namespace(), **harness.backpressure_options(N)) as tier:
        assert store(tier, [1]).all_ok
        with harness.stalled_stores(tier):
            first = tier.submit_store([(key(2), payload(key(2), N))])
            dropped = [tier.submit_store([(key(i), payload(key(i), N))]) for i in (3, 4)]
            for f in dropped:  # done at once: the engine never waits for a slow tier
                assert f.done()
                r = f.result()
                assert r.dropped and not r.all_ok and r.ok == (False,)
            s = tier.stats()
            assert (s.stores_dropped, s.keys_dropped) == (2, 2)
            assert load(tier, [1]) == [True]  # loads never wait behind stores
            assert not first.done()
        assert first.result(30).all_ok
        assert load(tier, [2, 3, 4]) == [True, False, False]


def check_close_is_bounded_and_leaves_nothing(harness: TierHarness) -> None:
    threads, fds = set(threading.enumerate()), _open_fds()
    tier = harness.open(fresh_namespace())
    assert store(tier, [0]).all_ok
    assert tier.lookup_async([key(0)]).result(30) == [True]
    futures = [tier.submit_store([(key(i), payload(key(i), N))]) for i in range(1, 40)]
    futures.append(tier.submit_load([(key(0), np.zeros(N, np.uint8))]))
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < CLOSE_S
    assert all(f.done() for f in futures)  # every job completed once: run or failed
    tier.close()  # idempotent
    try:
        tier.submit_store([(key(1), payload(key(1), N))])
    except TierClosedError:
        pass
    else:
        raise AssertionError("a closed tier took a store")
    deadline = time.monotonic() + CLOSE_S
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - threads, "threads left after close()"
    assert _open_fds() == fds, "descriptors (files, sockets) left after close()"


def check_concurrent_callers(harness: TierHarness) -> None:
    workers, per = 8, 6
    errors: list[BaseException] = []
    barrier = threading.Barrier(workers)
    with opened(harness, fresh_namespace()) as tier:

        def work(w: int) -> None:
            try:
                ids = range(w * per, (w + 1) * per)
                barrier.wait(30)
                assert store(tier, ids).all_ok
                assert tier.contains([key(i) for i in ids]) == [True] * per
                assert load(tier, ids) == [True] * per
            except BaseException as e:  # reported on the main thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        s = tier.stats()
        assert (s.keys_stored, s.load_hits, s.corrupt) == (workers * per,) * 2 + (0,)


def check_restart_reuse(harness: TierHarness) -> None:
    if not harness.persists:
        return
    ns = fresh_namespace()
    with opened(harness, ns) as tier:
        assert store(tier, range(3)).all_ok
    with opened(harness, ns) as again:  # a restarted engine on the same backing
        assert again.contains([key(0), key(1), key(2)]) == [True] * 3
        assert load(again, [0, 1, 2]) == [True] * 3


CHECKS = [
    check_the_kind_is_what_the_registry_says,
    check_round_trip,
    check_a_damaged_entry_is_a_miss_and_counted,
    check_a_buffer_of_another_length_raises_and_keeps_the_entry,
    check_namespaces_never_mix,
    check_a_slow_tier_drops_stores_and_says_so,
    check_close_is_bounded_and_leaves_nothing,
    check_concurrent_callers,
    check_restart_reuse,
]


def run_contract(harness: TierHarness, tmp_path: str) -> None:
    """Every check on `harness` (started on `tmp_path`, stopped at the end)."""
    harness.start(tmp_path)
    try:
        for check in CHECKS:
            check(harness)
    finally:
        harness.stop()
