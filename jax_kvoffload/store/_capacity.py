"""Host-tier sizing from a byte budget (vLLM 0.33.0 ``CPUOffloadingSpec``, ``cpu/spec.py``)."""

from __future__ import annotations

import dataclasses
import mmap

from ._errors import MISSING_BUDGET_MESSAGE, CapacityError, StoreTypeError

__all__ = ["HOST_PAGE_SIZE", "CPUTierCapacity", "cpu_tier_capacity"]

# vLLM aligns each chunk row to the host page (``mmap.PAGESIZE``; 4096 on x86-64) so
# rows of the shared region can be mapped, pinned and O_DIRECT-written independently.
HOST_PAGE_SIZE = mmap.PAGESIZE


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CPUTierCapacity:
    """The host tier's geometry.

    Attributes:
      num_chunks: Chunks the budget holds: ``cpu_bytes_to_use // kv_bytes_per_chunk``.
      kv_bytes_per_chunk: Bytes of one chunk row for all workers, rounded up to the
        host page (padding included).
      cpu_page_size_per_worker: Unpadded bytes of one worker's slot in a row.
      cpu_kv_cache_size_bytes: ``num_chunks * kv_bytes_per_chunk``.
    """

    num_chunks: int
    kv_bytes_per_chunk: int
    cpu_page_size_per_worker: int

    @property
    def cpu_kv_cache_size_bytes(self) -> int:
        return self.num_chunks * self.kv_bytes_per_chunk


_INT64 = 2**63 - 1


def _parse_budget(cpu_bytes_to_use: object) -> int:
    if cpu_bytes_to_use is None:
        raise CapacityError(
            f"{MISSING_BUDGET_MESSAGE} (got None); set e.g. "
            '{"cpu_bytes_to_use": 8 << 30} for 8 GiB of host memory.'
        )
    if isinstance(cpu_bytes_to_use, bool) or not isinstance(cpu_bytes_to_use, (int, str)):
        raise StoreTypeError(
            "cpu_bytes_to_use must be an int (or a decimal string, as vLLM's extra "
            f"config allows), got {type(cpu_bytes_to_use).__name__}: {cpu_bytes_to_use!r}."
        )
    try:
        budget = int(cpu_bytes_to_use)
    except ValueError:
        raise CapacityError(
            f"cpu_bytes_to_use={cpu_bytes_to_use!r} is not a whole number of bytes."
        ) from None
    if budget <= 0:
        raise CapacityError(
            f"{MISSING_BUDGET_MESSAGE}: cpu_bytes_to_use={cpu_bytes_to_use!r} must be > 0."
        )
    if budget > _INT64:  # host memory is indexed by int64 (numpy, mmap, the OS)
        raise CapacityError(
            f"cpu_bytes_to_use={budget} is past int64 ({_INT64} bytes); use the host "
            'memory to give the tier, e.g. {"cpu_bytes_to_use": 8 << 30} for 8 GiB.'
        )
    return budget


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise StoreTypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}.")
    if value < minimum:
        raise CapacityError(f"{name}={value} must be >= {minimum}.")
    if value > _INT64:
        raise CapacityError(f"{name}={value} is past int64 ({_INT64}); use the engine's value.")
    return value


def cpu_tier_capacity(
    cpu_bytes_to_use: int | str | None,
    *,
    worker_kv_bytes_per_block: int,
    blocks_per_chunk: int,
    world_size: int = 1,
    replicated_layout: bool = False,
    page_size: int = HOST_PAGE_SIZE,
) -> CPUTierCapacity:
    """Computes how many chunks a host byte budget holds, as vLLM 0.33.0 does.

    ``copies = 1 if replicated_layout else world_size``; a chunk row is
    ``worker_kv_bytes_per_block * copies * blocks_per_chunk`` bytes rounded up to
    ``page_size``; ``num_chunks = cpu_bytes_to_use // row``. With no KV bytes
    (``worker_kv_bytes_per_block == 0``) every size is 0.

    Args:
      cpu_bytes_to_use: Host bytes for the tier (vLLM's extra-config key; a decimal
        string is parsed like vLLM's ``int(...)``). Required and > 0.
      worker_kv_bytes_per_block: Bytes one worker stores per GPU block, over all
        registered KV tensors (``OffloadingConfig.worker_kv_bytes_per_block``).
      blocks_per_chunk: GPU blocks per chunk, >= 1.
      world_size: Workers sharing one chunk row, >= 1.
      replicated_layout: Every worker holds the same bytes, so a row keeps one copy.
        (vLLM honours it only where the shared host region is used.)
      page_size: Row alignment in bytes (the host page size).

    Raises:
      CapacityError: if ``cpu_bytes_to_use`` is missing, zero, negative or not a
        number, or a count is out of range.
      StoreTypeError: if an argument has the wrong type.
    """
    budget = _parse_budget(cpu_bytes_to_use)
    wkb = _check_count("worker_kv_bytes_per_block", worker_kv_bytes_per_block, 0)
    world = _check_count("world_size", world_size, 1)
    page = _check_count("page_size", page_size, 1)
    if not isinstance(replicated_layout, bool):
        raise StoreTypeError(
            f"replicated_layout must be a bool, got {type(replicated_layout).__name__}: "
            f"{replicated_layout!r}."
        )
    if wkb == 0:
        return CPUTierCapacity(num_chunks=0, kv_bytes_per_chunk=0, cpu_page_size_per_worker=0)
    bpc = _check_count("blocks_per_chunk", blocks_per_chunk, 1)
    copies = 1 if replicated_layout else world
    row = wkb * copies * bpc
    aligned = -(-row // page) * page
    return CPUTierCapacity(
        num_chunks=budget // aligned,
        kv_bytes_per_chunk=aligned,
        cpu_page_size_per_worker=row // copies,
    )
