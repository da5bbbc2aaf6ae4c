"""Run by test_single_caller.py in a subprocess: a SIGINT storm on a guarded entry.

    python single_caller_storm.py SECONDS guard|engine

A thread sends SIGINT every 0.2 ms while the main thread enters the guard (`guard`: a
bare `SingleCaller`; `engine`: a `TransferEngine`'s `has_finished`, whose body is the
guard and a dict check) over and over for SECONDS. Prints "signals N stuck BOOL": stuck
when an entry was refused ("another call is inside it") after the interrupts, i.e. the
guard was left held. Exits 0 either way; the test reads the line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

state = {"armed": False, "sent": 0}


def handler(signum, frame):
    if state["armed"]:
        raise KeyboardInterrupt


def build(kind: str):
    if kind == "guard":
        from jax_kvoffload._interrupts import SingleCaller

        class Refused(Exception):
            pass

        guard = SingleCaller("the guard", Refused)

        def enter():
            with guard:
                pass

        return enter, Refused
    import jax.numpy as jnp

    import pallas_kernels as pk
    from jax_kvoffload.errors import KVOffloadStateError
    from jax_kvoffload.hostmem import HostChunkPool
    from jax_kvoffload.transfer import GroupCaches, TransferEngine

    gc = GroupCaches([jnp.zeros((4, 2, 2, 8), jnp.uint16)], pk.KVLayout.nhd())
    engine = TransferEngine({0: gc}, HostChunkPool(4, {0: gc.block_bytes}, 1))
    return engine.has_finished, KVOffloadStateError


def run(enter, refused, deadline: float) -> bool:
    while True:  # an interrupt outside the entry lands here: go on
        try:
            while time.monotonic() < deadline:
                try:
                    enter()
                except KeyboardInterrupt:
                    pass
                except refused:
                    return True
            return False
        except KeyboardInterrupt:
            pass


def main() -> int:
    seconds, kind = float(sys.argv[1]), sys.argv[2]
    enter, refused = build(kind)
    signal.signal(signal.SIGINT, handler)
    stop = threading.Event()

    def storm():
        pid = os.getpid()
        while not stop.is_set():
            os.kill(pid, signal.SIGINT)
            state["sent"] += 1
            time.sleep(0.0002)

    thread = threading.Thread(target=storm, daemon=True)
    thread.start()
    state["armed"] = True
    stuck = False
    for _ in range(1000):
        try:
            stuck = run(enter, refused, time.monotonic() + seconds)
            break
        except KeyboardInterrupt:
            continue
    state["armed"] = False
    stop.set()
    thread.join()
    try:
        enter()
    except refused:
        stuck = True
    print(f"signals {state['sent']} stuck {stuck}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
