"""MooncakeTier against a master that hangs (stopped, or behind a partition that drops
packets): Mooncake's client answers each call with RPC_TIMEOUT (-901) after its own RPC
timeout (~30 s). The tier must take that as the master down, as it takes RPC_FAIL: no
further call asks the master (each would wait another 30 s, one key after another, and
hold `close()` that long). The fast tests stand a client in front of the real one that
answers -901; the slow one stops a real master (SIGSTOP)."""

from __future__ import annotations

import secrets
import signal
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.config import MooncakeTierConfig
from jax_kvoffload.tiers import MooncakeTier
from jax_kvoffload.tiers import _mooncake_client as mc

from ._helpers import key, payload
from ._mooncake import NO_MOONCAKE, MooncakeStore

pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=str(NO_MOONCAKE))

N = 8192


@pytest.fixture(scope="module")
def store():
    s = MooncakeStore(segment="64MB")
    yield s
    s.stop()


def open_tier(store, **kw):
    cfg = MooncakeTierConfig(**store.options(), read_threads=1, write_threads=1, **kw)
    return MooncakeTier(cfg, secrets.token_bytes(32))


class TimingOut:
    """Mooncake's client as it answers while the master hangs: every master call -901;
    counts the calls that would each have waited the RPC timeout."""

    def __init__(self, real):
        self._real, self.calls = real, 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        self.calls += 1
        return [mc.RPC_TIMEOUT] * len(keys)

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config):
        self.calls += 1
        return [mc.RPC_TIMEOUT] * len(keys)

    def batch_is_exist(self, keys):
        self.calls += 1
        return [mc.RPC_TIMEOUT] * len(keys)

    def get_size(self, key):
        self.calls += 1
        return mc.RPC_TIMEOUT


@pytest.mark.parametrize("first", ["load", "store", "contains"])
def test_rpc_timeout_marks_the_master_down_and_asks_it_no_more(store, first):
    tier = open_tier(store, retry_after_s=60)
    real = tier._store
    fake = tier._store = TimingOut(real)
    try:
        outs = [np.zeros(N, np.uint8) for _ in range(8)]
        loads = [(key(i), o) for i, o in enumerate(outs)]
        if first == "load":
            assert list(tier.submit_load(loads).result(30).ok) == [False] * 8
        elif first == "store":
            items = [(key(i), payload(key(i), N)) for i in range(8)]
            assert list(tier.submit_store(items).result(30).ok) == [False] * 8
        else:
            assert tier.contains([key(i) for i in range(8)]) == [False] * 8
        assert fake.calls == 1, f"{fake.calls} calls to a master that timed out"
        assert not tier.available()  # down: loads miss and stores drop at once
        assert list(tier.submit_load(loads).result(30).ok) == [False] * 8
        assert tier.contains([key(0)]) == [False]
        assert fake.calls == 1
    finally:
        tier._store = real
        tier.close()


def test_a_segment_too_large_to_allocate_is_named_at_opening(store):
    # Mooncake's setup answers -600 when it cannot allocate the segment; the error said
    # "start mooncake_master there" although the master runs.
    with pytest.raises(mc.MooncakeUnavailableError, match="global_segment_size=4611686"):
        open_tier(store, global_segment_size=1 << 62)


@pytest.mark.slow  # Mooncake's RPC timeout is ~30 s
def test_a_stopped_master_mid_load_bounds_the_load_and_close(store):
    tier = open_tier(store, retry_after_s=60)
    items = [(key(i), payload(key(i), N)) for i in range(8)]
    assert all(tier.submit_store(items).result(30).ok)
    store.master.send_signal(signal.SIGSTOP)
    try:
        outs = [np.zeros(N, np.uint8) for _ in range(8)]
        t0 = time.monotonic()
        job = tier.submit_load([(key(i), o) for i, o in enumerate(outs)])
        time.sleep(0.3)
        closer = threading.Thread(target=tier.close)
        closer.start()
        closer.join(90)  # one call's RPC timeout, not one per key (8 x 30 s before)
        assert not closer.is_alive(), "close() still waits on a stopped master"
        assert list(job.result(5).ok) == [False] * 8
        assert time.monotonic() - t0 < 90
    finally:
        store.master.send_signal(signal.SIGCONT)
