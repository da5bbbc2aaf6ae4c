"""Strided byte copies between block rows: the canonical relayout as a few numpy views.

A layer's `CopyRun` is a strided family of equal fragments. Layers of a group usually
share their runs and sit at evenly spaced offsets, so one `StridedCopy` (layers x
fragments x bytes, each level with its own stride on either side) covers a run of every
layer; a batch of blocks then adds one more level, the block rows. Copying such a family
is a single numpy assignment between two strided views whose innermost axis is a
contiguous fragment, which numpy runs as one memmove per fragment with the GIL released.
Replacing the plain row copy that the direct path makes anyway, it moves the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
from numpy.lib.stride_tricks import as_strided

from jax_kvoffload.config.canonical import CopyRun

# Copies below this many bytes per thread stay on the calling thread.
_PARALLEL_BYTES = 4 << 20

# Above this many arithmetic slot segments per batch (e.g. one block per chunk, chunks
# scattered in the pool), one fancy-indexed assignment per family beats a Python loop.
_MAX_SEGMENTS = 32


@dataclass(frozen=True)
class StridedCopy:
    """`layers x fragments` fragments of `size` bytes.

    Fragment (i, j) spans `[local + i*local_steps[0] + j*local_steps[1], +size)` of a local
    block row and the same with the canonical fields in a canonical block row."""

    local: int
    canonical: int
    size: int
    layers: int
    fragments: int
    local_steps: tuple[int, int]
    canonical_steps: tuple[int, int]

    @classmethod
    def of_run(cls, run: CopyRun, local_base: int, canonical_base: int) -> StridedCopy:
        """One layer's run, its page at `local_base` / `canonical_base` of the rows."""
        return cls(
            local=local_base + run.local_offset,
            canonical=canonical_base + run.canonical_offset,
            size=run.fragment_size,
            layers=1,
            fragments=run.num_fragments,
            local_steps=(0, run.local_stride),
            canonical_steps=(0, run.canonical_stride),
        )

    def with_layers(self, layers: int, local_step: int, canonical_step: int) -> StridedCopy:
        return dataclasses.replace(
            self,
            layers=layers,
            local_steps=(local_step, self.local_steps[1]),
            canonical_steps=(canonical_step, self.canonical_steps[1]),
        )

    def contiguous(self) -> bool:
        """Fragments back to back, layers back to back, on both sides."""
        block = self.fragments * self.size
        return all(
            (self.fragments == 1 or steps[1] == self.size)
            and (self.layers == 1 or steps[0] == block)
            for steps in (self.local_steps, self.canonical_steps)
        )

    @property
    def nbytes(self) -> int:
        return self.layers * self.fragments * self.size

    def _shape(self, rows: int) -> tuple[int, int, int, int]:
        return (rows, self.layers, self.fragments, self.size)

    def local_view(self, rows: np.ndarray) -> np.ndarray:
        """The family's fragments of `rows` (`[n, width]` uint8, C-contiguous)."""
        return _view(rows, self.local, self._shape(rows.shape[0]), self.local_steps)

    def canonical_view(self, rows: np.ndarray) -> np.ndarray:
        return _view(rows, self.canonical, self._shape(rows.shape[0]), self.canonical_steps)


def _view(
    rows: np.ndarray, offset: int, shape: tuple[int, ...], steps: tuple[int, int]
) -> np.ndarray:
    if not rows.flags.c_contiguous or rows.dtype != np.uint8:
        raise ValueError("block rows must be a C-contiguous uint8 array")
    base = rows.reshape(-1)[offset:]
    return as_strided(base, shape, (rows.shape[1], *steps, 1), writeable=rows.flags.writeable)


def merge_copies(copies: Iterable[StridedCopy]) -> list[StridedCopy]:
    """Folds per-layer families into multi-layer ones where layers repeat evenly.

    A copy joins the latest family of the same fragment shape when it sits exactly one
    layer step after that family's last layer (the first join sets the steps)."""
    out: list[StridedCopy] = []
    latest: dict[tuple[int, int, int, int], int] = {}
    for c in copies:
        key = (c.size, c.fragments, c.local_steps[1], c.canonical_steps[1])
        i = latest.get(key)
        if i is not None and c.layers == 1:
            f = out[i]
            dl, dc = c.local - f.local, c.canonical - f.canonical
            if f.layers == 1 and dl > 0 and dc > 0:
                out[i] = f.with_layers(2, dl, dc)
                continue
            steps = (f.local_steps[0], f.canonical_steps[0])
            if f.layers > 1 and (dl, dc) == (f.layers * steps[0], f.layers * steps[1]):
                out[i] = f.with_layers(f.layers + 1, *steps)
                continue
        latest[key] = len(out)
        out.append(c)
    return out


def segments(slots: np.ndarray, positions: np.ndarray, step: int) -> list[tuple[int, int, int]]:
    """Splits `(slots[k], positions[k])` into runs where both advance by `step`:
    `[(first_slot, first_position, count)]`."""
    if slots.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(slots) != step) | (np.diff(positions) != step)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [slots.size])))
    return [(int(slots[s]), int(positions[s]), int(c)) for s, c in zip(starts, counts, strict=True)]


def copy_threads() -> int:
    """Threads a large host copy is split over: `JAX_KVOFFLOAD_COPY_THREADS`, else
    `min(4, cpu count)`. numpy copies with the GIL released, so they run in parallel."""
    value = os.environ.get("JAX_KVOFFLOAD_COPY_THREADS")
    if value is not None:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(
                f"JAX_KVOFFLOAD_COPY_THREADS={value!r}: give a whole number of threads"
            ) from None
    return max(1, min(4, _cpus()))


@functools.cache
def _cpus() -> int:
    # Asked once: os.cpu_count() reads /sys on Linux (~50 us a call after an idle
    # pause, measured in a 0.25 MiB load on the CI VM).
    return os.cpu_count() or 1


_executor: ThreadPoolExecutor | None = None
_executor_workers = 0
_executor_lock = threading.Lock()


def _forget_pool() -> None:
    # A forked child inherits the pool object but none of its threads: submitting to it
    # would wait forever (found in review). The child builds its own on first use.
    global _executor, _executor_workers, _executor_lock
    _executor, _executor_workers, _executor_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool(workers: int) -> ThreadPoolExecutor:
    global _executor, _executor_workers
    with _executor_lock:
        if _executor is None or _executor_workers < workers:
            # Not shut down: another caller may be submitting to the old pool; its idle
            # threads exit once it is collected.
            _executor = ThreadPoolExecutor(workers, thread_name_prefix="kv-copy")
            _executor_workers = workers
        return _executor


def _run(tasks: Sequence[Callable[[], None]]) -> None:
    """Runs the tasks, the first on this thread and the others on the copy pool (or here,
    when the pool refuses work, e.g. at interpreter exit); re-raises the first failure
    only after every task has ended, so none is left writing into the caller's rows."""
    futures = []
    inline = tasks[:1]
    if len(tasks) > 1:
        pool = _pool(max(copy_threads() - 1, 1))
        for i, task in enumerate(tasks[1:], start=1):
            try:
                futures.append(pool.submit(task))
            except RuntimeError:  # shut down: run what is left on this thread
                inline = [tasks[0], *tasks[i:]]
                break
    error: BaseException | None = None
    for task in inline:
        try:
            task()
        except BaseException as e:  # re-raised below, once the others have ended
            error = error or e
    for f in futures:
        exc = f.exception()
        error = error or exc
    if error is not None:
        raise error


def _parts(rows: int, row_bytes: int) -> int:
    """How many threads a copy of `rows` rows deserves (one per _PARALLEL_BYTES)."""
    return max(1, min(copy_threads(), rows, rows * row_bytes // _PARALLEL_BYTES))


def copy_rows(
    dst: np.ndarray,
    dst_rows: np.ndarray,
    src: np.ndarray,
    src_rows: np.ndarray,
    step: int,
) -> None:
    """`dst[dst_rows[k]] = src[src_rows[k]]` for views whose first axis is the block row;
    arithmetic runs become slice assignments (no temporaries). Copies of several MiB are
    split by rows over `copy_threads()` threads."""
    n = len(src_rows)
    if n == 0:
        return
    parts = _parts(n, src[0].nbytes)
    segs = segments(dst_rows, src_rows, step)
    if len(segs) > _MAX_SEGMENTS:
        pieces = np.array_split(np.arange(n), parts)
        tasks = [partial(_fancy, dst, dst_rows[p], src, src_rows[p]) for p in pieces]
    else:
        size = -(-n // parts)  # rows per piece
        tasks = [
            partial(_slices, dst, src, d + k * step, s + k * step, min(size, c - k), step)
            for d, s, c in segs
            for k in range(0, c, size)
        ]
    _run(tasks)


def _fancy(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    dst[dst_rows] = src[src_rows]


def _slices(dst: np.ndarray, src: np.ndarray, d: int, s: int, n: int, step: int) -> None:
    dst[d : d + (n - 1) * step + 1 : step] = src[s : s + (n - 1) * step + 1 : step]
