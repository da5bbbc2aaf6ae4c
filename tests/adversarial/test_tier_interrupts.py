"""Ctrl-C on the caller's thread while a tier call blocks (the realistic interrupt: it
lands in a wait). A `contains()` interrupted mid-reply must not hand its connection,
with the late reply still coming, to the next caller; a `close()` interrupted while it
waits for running I/O must be completed by calling `close()` again (threads joined,
descriptors closed), as the offloader's `close()` is."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig, RedisTier, RedisTierConfig

from ._fake_resp import FakeResp

NS = bytes(range(32))
K1, K2 = b"\x01" * 32 + bytes(4), b"\x02" * 32 + bytes(4)

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)


def interrupt_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def tier_threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_an_interrupted_contains_never_passes_on_its_connection():
    # K1's answer (":1", it exists) comes late; K2 does not exist (":0" at once). Before:
    # the interrupted call put its connection back in the pool, and the next contains()
    # read K1's late ":1" as K2's answer.
    released, answered = threading.Event(), threading.Event()

    def reply(conn, args):
        if args[1].endswith(K1[:-4].hex().encode() + b":0"):
            released.wait(10)  # answers only once the caller has been interrupted
            answered.set()
            return b":1\r\n"
        return b":0\r\n"

    with FakeResp(reply) as server:
        t = RedisTier(RedisTierConfig(url=server.url, io_timeout_s=10.0), NS)
        try:
            timer = interrupt_after(0.2)
            with pytest.raises(KeyboardInterrupt):
                t.contains([K1])
            timer.join()
            released.set()
            assert answered.wait(10)
            time.sleep(0.05)  # the late reply is on its way back
            assert t.contains([K2]) == [False]
        finally:
            t.close()


def test_an_interrupted_close_is_completed_by_the_next_close(tmp_path, monkeypatch):
    before = open_fds()
    tier = DiskTier(
        DiskTierConfig(path=str(tmp_path / "t"), capacity_bytes=1 << 20, write_threads=1), NS
    )
    slow, running, released = DiskTier._store_one, threading.Event(), threading.Event()

    def store_one(self, *args):
        running.set()
        released.wait(10)  # a slow disk: close() waits for this running write
        return slow(self, *args)

    monkeypatch.setattr(DiskTier, "_store_one", store_one)
    future = tier.submit_store([(K1, np.arange(64, dtype=np.uint8))])
    assert running.wait(10)
    timer = interrupt_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        tier.close()
    timer.join()
    released.set()
    tier.close()  # before: returned at once, leaving the descriptors open
    assert future.result(5).ok == (True,)
    assert not tier_threads("disk-tier")
    assert open_fds() <= before, "descriptors left open"


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_a_task_raising_a_base_exception_fails_its_keys_only(tmp_path, monkeypatch, exc):
    # Before: the I/O thread died with the task; its job's future never completed, so
    # drain() never returned True and vLLM's drain_jobs() would wait forever.
    tier = DiskTier(
        DiskTierConfig(path=str(tmp_path / "t"), capacity_bytes=1 << 20, write_threads=1), NS
    )
    try:
        store = DiskTier._store_one
        calls = []

        def store_one(self, *args):
            calls.append(1)
            if len(calls) == 1:
                raise exc("injected")
            return store(self, *args)

        monkeypatch.setattr(DiskTier, "_store_one", store_one)
        row = np.arange(64, dtype=np.uint8)
        assert tier.submit_store([(K1, row)]).result(5).ok == (False,)
        assert tier.drain(5)
        assert tier.submit_store([(K2, row)]).result(5).ok == (True,)  # the thread lives
    finally:
        tier.close()


def test_a_close_interrupted_between_its_descriptors_never_closes_a_foreign_one(
    tmp_path, monkeypatch
):
    # Ctrl-C after the namespace directory's descriptor was closed, before the root's:
    # the next close() closed the namespace's number again, by then reused by another
    # file of the process (here: one opened in between), which then failed its reads.
    before = open_fds()
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "t"), capacity_bytes=1 << 20), NS)
    ns_fd, real_close = tier._ns_fd, os.close

    def close(fd):
        real_close(fd)
        if fd == ns_fd:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "close", close)
    with pytest.raises(KeyboardInterrupt):
        tier.close()
    monkeypatch.setattr(os, "close", real_close)
    other = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert other == ns_fd  # the lowest free number: the one just closed
        tier.close()  # completes the first: the root's descriptor only
        os.fstat(other)  # still open
    finally:
        os.close(other)
    assert open_fds() <= before, "the root's descriptor was left open"
