"""The locking contract: KVOffloader and TransferEngine are driven from one thread at a
time. A call from a second thread while another is inside is refused with a state
error (it never corrupts the maps); calls from different threads one after another
are fine."""

from __future__ import annotations

import threading
import time

import numpy as np

from jax_kvoffload.errors import KVOffloadStateError
from jax_kvoffload.hostmem import HostChunkPool
from tests.faults._helpers import (
    Gate,
    Reports,
    blocks,
    expected,
    hashes,
    offloader,
    pins,
    write_blocks,
)


def test_a_second_thread_is_refused_while_the_first_waits(monkeypatch):
    off = offloader()
    h = hashes("a", 2)
    write_blocks(off, [1, 2], h)
    assert off.wait([off.store(h, [1, 2])])[0].success
    gate = Gate(monkeypatch, HostChunkPool, "read_blocks")
    load = off.load(h, [10, 11])
    refusals: list[BaseException] = []

    def second():
        assert gate.entered.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not refusals:
            for call in (lambda: off.lookup(h), off.poll, lambda: off._engine.arrays(0)):
                try:
                    call()
                except KVOffloadStateError as e:
                    refusals.append(e)
            time.sleep(0.01)
        gate.open()

    thread = threading.Thread(target=second)
    thread.start()
    (result,) = off.wait([load])  # blocks until the second thread opens the gate
    thread.join(10)
    assert refusals and "while another call is inside" in str(refusals[0])
    assert result.success
    np.testing.assert_array_equal(blocks(off, [10, 11]), expected(h))
    # One after the other, any thread may call.
    other = threading.Thread(target=lambda: off.lookup(h))
    other.start()
    other.join(10)
    off.close()


def test_two_threads_hammering_never_corrupt_anything():
    off = offloader()
    reports = Reports()
    lock = threading.Lock()
    unexpected: list[BaseException] = []
    prompts = [hashes(f"p{i}", 2) for i in range(6)]
    write_blocks(off, list(range(12)), [h for p in prompts for h in p])
    refused = [0]

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            i = int(rng.integers(len(prompts)))
            op = rng.choice(["store", "lookup", "poll"])
            try:
                if op == "store":
                    job = off.store(prompts[i], [2 * i, 2 * i + 1])
                    with lock:
                        reports.issue(job)
                elif op == "lookup":
                    off.lookup(prompts[i])
                else:
                    results = off.poll()
                    with lock:
                        reports.record(results)
            except KVOffloadStateError:
                with lock:
                    refused[0] += 1
            except BaseException as e:
                unexpected.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not unexpected, unexpected
    reports.record(off.wait())
    assert pins(off) == (0, 0)
    reports.record(off.close())
    reports.check_exactly_once()
    assert all(reports.results[j].success for j in reports.issued)
    print(f"refused {refused[0]} concurrent calls")
