"""`GroupCaches`: one group's device KV arrays, checked when they are handed over.

Every check here is one the kernels would otherwise fail later, inside a job, with a
message about their own internals (or an `AttributeError` on a numpy array): refusing
at the hand-over names the group, the array and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config.internals import checked_arguments, sub_byte_bits
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.transfer._errors import TransferError, TransferStateError
from jax_kvoffload.transfer._rpa_pages import check_rpa_heads, host_page_shape, relays


def _buffers(array: jax.Array) -> list[int]:
    """Device buffer addresses of `array` (one per addressable shard), [] if unknown."""
    try:
        return [s.data.unsafe_buffer_pointer() for s in array.addressable_shards]
    except Exception:  # platforms without raw pointers: identity checks only
        return []


def check_arrays(arrays: object, layout: pk.KVLayout, where: str) -> list[jax.Array]:
    """`arrays` as a list after the checks every group's arrays must pass."""
    if not isinstance(arrays, (list, tuple)):
        raise KVOffloadTypeError(
            f"{where}: arrays must be a list of jax.Array (one per layer, or K and V), "
            f"got {type(arrays).__name__} {arrays!r:.40}; pass e.g. [k0, v0, k1, v1]"
        )
    if not arrays:
        raise TransferError(f"{where}: arrays is empty; pass the group's cache arrays")
    for i, a in enumerate(arrays):
        if not isinstance(a, jax.Array):
            fix = (
                " (move it to the device with jax.device_put)" if isinstance(a, np.ndarray) else ""
            )
            raise KVOffloadTypeError(
                f"{where}: arrays must be a list of jax.Array; arrays[{i}] is a "
                f"{type(a).__name__}{fix}"
            )
        if a.is_deleted():
            raise TransferStateError(
                f"{where}: arrays[{i}] was deleted (donated to another computation); "
                "pass the live arrays, e.g. those a scatter or your jit step returned"
            )
        bits = sub_byte_bits(a.dtype)
        if bits is not None:
            raise TransferError(
                f"{where}: arrays[{i}] has dtype {np.dtype(a.dtype).name} ({bits} bits per "
                "element), which the kernels cannot move (they move whole bytes); keep the "
                "packed values in uint8 words (jax.lax.bitcast_convert_type) and pass those"
            )
        try:
            layout.check_cache(tuple(a.shape), a.dtype, name=f"{where}: arrays[{i}]")
        except (TypeError, ValueError) as e:
            kind = KVOffloadTypeError if isinstance(e, TypeError) else TransferError
            raise kind(str(e)) from None
    first = arrays[0]
    for i, a in enumerate(arrays[1:], 1):
        if a.shape != first.shape or a.dtype != first.dtype:
            raise TransferError(
                f"{where}: every array of a group has one shape and dtype; arrays[0] is "
                f"{tuple(first.shape)} {first.dtype}, arrays[{i}] is {tuple(a.shape)} {a.dtype}"
            )
    shape = tuple(first.shape)
    if layout.num_blocks(shape) < 1 or 0 in layout.page_shape(shape):
        raise TransferError(
            f"{where}: arrays of shape {shape} ({layout.describe()}) hold no blocks or "
            "empty pages; every dimension must be >= 1"
        )
    if layout.kv_stacking is pk.KVStacking.SEPARATE and len(arrays) % 2:
        raise TransferError(
            f"{where}: kv_stacking=SEPARATE takes K, V pairs [k0, v0, k1, v1, ...]; got "
            f"{len(arrays)} arrays"
        )
    check_distinct(arrays, where)
    return list(arrays)


def check_distinct(arrays: Iterable[jax.Array], where: str) -> None:
    """Refuses one array (or one device buffer) passed twice: a donating scatter would
    write it twice and delete it under the other name."""
    seen: dict[int, int] = {}
    owners: dict[int, int] = {}
    for i, a in enumerate(arrays):
        if id(a) in seen:
            raise TransferError(
                f"{where}: arrays[{seen[id(a)]}] and arrays[{i}] are the same array; every "
                "layer needs its own"
            )
        seen[id(a)] = i
        for pointer in set(_buffers(a)):  # replicas of one array may share a buffer
            if pointer in owners:
                raise TransferError(
                    f"{where}: arrays[{owners[pointer]}] and arrays[{i}] share a device "
                    "buffer; every layer needs its own (copy one with jnp.array(a, copy=True))"
                )
            owners[pointer] = i


@checked_arguments
@dataclass
class GroupCaches:
    """A group's device KV arrays (one per layer, or K and V) and their `KVLayout`
    (or its name, e.g. "rpa" for ragged-paged-attention v3 caches: `pk.LAYOUT_NAMES`).

    The arrays are checked on construction: jax.Arrays (not numpy), one shape and
    dtype, a rank that fits `layout`, at least one block, no array twice.
    """

    arrays: list[jax.Array]
    layout: pk.KVLayout
    #: RPA caches only: the model's KV heads, for canonical host pages (`_rpa_pages`).
    canonical_kv_heads: int | None = None

    if TYPE_CHECKING:
        # What the constructor takes: __post_init__ makes the fields' types of both.
        def __init__(
            self,
            arrays: Sequence[jax.Array],
            layout: pk.KVLayout | str,
            canonical_kv_heads: int | None = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        if isinstance(self.layout, str):  # a layout name: "rpa", "nhd_second", ...
            self.layout = layout_named(self.layout, "GroupCaches")
        if not isinstance(self.layout, pk.KVLayout):
            raise KVOffloadTypeError(
                f"layout must be a pallas_kernels.KVLayout (e.g. KVLayout.nhd()) or one of "
                f"the names {list(pk.LAYOUT_NAMES)}, got {type(self.layout).__name__}"
            )
        self.arrays = check_arrays(self.arrays, self.layout, "GroupCaches")
        if self.canonical_kv_heads is not None:
            self.canonical_kv_heads = check_rpa_heads(
                self.arrays, self.layout, self.canonical_kv_heads, "GroupCaches"
            )

    @property
    def host_page_shape(self) -> tuple[int, ...]:
        """`(arrays, *page)` of one block in host rows (canonical RPA pages: heads
        `canonical_kv_heads`, per-shard padding dropped)."""
        return host_page_shape(self.arrays, self.layout, self.canonical_kv_heads)

    @property
    def on_accelerator(self) -> bool:
        """The arrays live on a GPU or TPU (a host pool "auto" is then "pinned")."""
        return bool(next(iter(self.arrays[0].devices())).platform != "cpu")

    @property
    def relays(self) -> bool:
        """The host pages are not the gathered bytes: stores and loads relay them."""
        return relays(self.arrays, self.canonical_kv_heads)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every array of the group (one host row's block)."""
        return int(np.prod(self.host_page_shape)) * np.dtype(self.arrays[0].dtype).itemsize

    def check_replacement(self, arrays: list[jax.Array], where: str) -> None:
        """Refuses arrays that would change the host pages: the same count, shapes and
        dtypes as now, except that canonical RPA caches may change their KV-head sharding
        (another mesh pads differently) as long as their canonical pages stay the same."""
        want = [(tuple(a.shape), a.dtype) for a in self.arrays]
        got = [(tuple(a.shape), a.dtype) for a in arrays]
        if self.canonical_kv_heads is not None and len(got) == len(want):
            check_rpa_heads(arrays, self.layout, self.canonical_kv_heads, where)
            shape = host_page_shape(arrays, self.layout, self.canonical_kv_heads)
            same_blocks = arrays[0].shape[0] == self.arrays[0].shape[0]
            if same_blocks and shape == self.host_page_shape and got[0][1] == want[0][1]:
                return
        if got != want:
            raise TransferError(
                f"{where}: arrays must keep the shapes and dtypes of the current "
                f"ones: {len(want)} x {want[0][0]} {want[0][1]}, got {len(got)} arrays "
                f"{sorted({f'{shape} {dtype}' for shape, dtype in got})}"
            )

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks(tuple(self.arrays[0].shape))


def layout_named(name: str, where: str) -> pk.KVLayout:
    """The `KVLayout` called `name` (`pallas_kernels.LAYOUT_NAMES`), or a typed error."""
    try:
        return pk.named_layout(name)
    except pk.LayoutError as e:
        raise TransferError(f"{where}: layout={name!r}: {e}") from None


def check_group_caches(caches: object, where: str) -> dict[int, GroupCaches]:
    """A mapping group id -> `GroupCaches`, checked (keys ints, values GroupCaches)."""
    if not isinstance(caches, Mapping):
        raise KVOffloadTypeError(
            f"{where}: caches must be a mapping group id -> GroupCaches, got "
            f"{type(caches).__name__}; wrap the arrays: {{0: GroupCaches(arrays, layout)}}"
        )
    out: dict[int, GroupCaches] = {}
    for g, gc in caches.items():
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
            raise KVOffloadTypeError(f"{where}: group ids must be ints, got {g!r}")
        if not isinstance(gc, GroupCaches):
            raise KVOffloadTypeError(
                f"{where}: caches[{g}] must be a GroupCaches(arrays, layout), got "
                f"{type(gc).__name__}"
            )
        out[int(g)] = gc
    if not out:
        raise TransferError(f"{where}: caches is empty; pass at least one group")
    return out
