"""The torch worker's view of vLLM's KV tensors and refs, checked once at construction.

`TorchKVWorker` takes vLLM's `CanonicalKVCaches` as they are: `tensors`, pairs of
`(tensor, page_size_bytes)`, and per group the `(tensor_idx, unpadded_page_bytes)` refs
of its layers. `check_layout` turns them into each tensor's byte geometry
(`TensorBytes`), the checked refs and the bytes a host slot holds per block, refusing
what vLLM's validators would not produce with a typed error naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jax_kvoffload.bridge._job_plan import JobSpecError
from jax_kvoffload.bridge._tensor_bytes import TensorBytes
from jax_kvoffload.errors import KVOffloadTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["TensorLayout", "check_int", "check_layout", "host_widths"]


@dataclass(frozen=True)
class TensorLayout:
    """What the worker moves: `geo[t]` the bytes of tensor t, `group_refs[g]` the
    checked refs of group g, `widths` the bytes a host slot holds per block of each
    tensor a ref points at (`host_widths`), `ref_widths` the distinct ref widths per
    tensor."""

    geo: list[TensorBytes]
    group_refs: list[list[tuple[int, int]]]
    widths: dict[int, int]
    ref_widths: dict[int, set[int]]


def check_layout(
    tensors: Sequence[tuple[torch.Tensor, int]], group_refs: Sequence[Sequence[tuple[int, int]]]
) -> TensorLayout:
    """vLLM's tensors and refs, checked (see the module docstring)."""
    _check_list("tensors", tensors)
    _check_list("group_refs", group_refs)
    geo = [
        TensorBytes.of(*_pair("tensors", i, pair), name=f"tensors[{i}]")
        for i, pair in enumerate(tensors)
    ]
    pairs = [
        [
            _pair(f"group_refs[{g}]", i, ref)
            for i, ref in enumerate(_check_list(f"group_refs[{g}]", refs))
        ]
        for g, refs in enumerate(group_refs)
    ]
    checked_refs: list[list[tuple[int, int]]] = []
    ref_widths: dict[int, set[int]] = {}
    for g, refs in enumerate(pairs):
        checked = []
        for raw_idx, raw_unpadded in refs:
            idx = check_int(f"group {g} ref tensor_idx", raw_idx, 0)
            unpadded = check_int(f"group {g} ref page_size_bytes", raw_unpadded, 0)
            checked.append((idx, unpadded))
            if idx >= len(geo) or unpadded > geo[idx].page:
                raise JobSpecError(
                    f"group {g}: a ref to tensor {idx} of {unpadded} bytes; refs must "
                    f"point at one of the {len(geo)} tensors and fit its page"
                )
            if unpadded:
                ref_widths.setdefault(idx, set()).add(unpadded)
        checked_refs.append(checked)
    widths = host_widths(checked_refs)
    for t, width in widths.items():
        geo[t].check_width(width, f"tensor {t}")
    return TensorLayout(geo, checked_refs, widths, ref_widths)


def host_widths(group_refs: Sequence[Sequence[tuple[int, int]]]) -> dict[int, int]:
    """Tensor index -> bytes a host slot holds per block: the widest unpadded page of the
    refs on that tensor (vLLM copies each ref's page from the start of the block's row,
    so the widest covers every ref). Tensors without a non-empty ref are left out."""
    out: dict[int, int] = {}
    for refs in group_refs:
        for idx, unpadded in refs:
            if unpadded:
                out[idx] = max(out.get(idx, 0), unpadded)
    return dict(sorted(out.items()))


def _check_list(what: str, value: object) -> Sequence[object]:
    # A group that is not a list (``[5]``, ``[None]``) raised a bare "object is not
    # iterable" that named neither the argument nor the fix.
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        example = {"tensors": "[(tensor, page_size_bytes)]", "group_refs": "[[(0, page)]]"}
        raise KVOffloadTypeError(
            f"{what} must be a list (vLLM's CanonicalKVCaches.{what}), got "
            f"{type(value).__name__} {value!r:.40}; pass e.g. " + example.get(what, "[(0, page)]")
        )
    return value


def _pair(name: str, index: int, value: object) -> tuple[object, object]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise KVOffloadTypeError(
            f"{name}[{index}] must be a pair (tensors: (tensor, page_size_bytes); refs: "
            f"(tensor_idx, unpadded_page_bytes)), got {value!r:.80}"
        )
    return value[0], value[1]


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KVOffloadTypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise JobSpecError(f"{name}={value} must be >= {minimum}")
    return int(value)
