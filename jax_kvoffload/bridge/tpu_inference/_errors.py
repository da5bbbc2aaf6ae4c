"""The typed errors of the tpu-inference connector (on the library's error root)."""

from __future__ import annotations

from jax_kvoffload.errors import KVOffloadStateError, KVOffloadValueError

__all__ = ["TPUConnectorConfigError", "TPUConnectorStateError", "UnknownChunkError"]


class TPUConnectorConfigError(KVOffloadValueError):
    """A configuration the connector does not serve: names the setting, its value and
    what to use instead."""

    def __init__(self, setting: str, value: object, fix: str) -> None:
        super().__init__(f"{setting}={value!r}: {fix}")
        self.setting = setting
        self.value = value
        self.fix = fix


class TPUConnectorStateError(KVOffloadStateError):
    """The connector cannot do what the engine asked now (e.g. a worker without its
    scheduler in this process, a load that did not complete)."""


class UnknownChunkError(KVOffloadValueError):
    """`mark_completion` named chunk ids the store never handed out (theirs raises
    `ValueError` too): names the ids and the operation."""

    def __init__(self, operation: str, chunk_ids: list[int], unknown: list[int]) -> None:
        super().__init__(
            f"mark_completion({chunk_ids}, {operation!r}): chunks {unknown} were never "
            "allocated for a save or pinned for a load; nothing was changed"
        )
        self.operation = operation
        self.chunk_ids = chunk_ids
        self.unknown = unknown
