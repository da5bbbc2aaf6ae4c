"""Random scheduler-like call traces run on our manager and on vLLM's, side by side.

Used by `test_vllm_manager_diff.py` (imported only when vLLM is importable). Both
managers are built from one vLLM `OffloadingConfig` through their specs
(`JaxOffloadingSpec` and vLLM's `CPUOffloadingSpec`) and driven through vLLM's
`OffloadingManager` interface with vLLM's own `ReqContext`s. Keys and their positions
come from vLLM's scheduler code (`RequestOffloadState.update_offload_keys`) over a
prefix-sharing pool of block hashes, so requests share chunks as real prompts do.

Every return value is compared (lookup results, load and store chunk ids, evicted keys,
events, stats, error families); the first difference raises `Divergence` naming the
seed and the call index. Both sides get their own contexts (identical positions).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import types
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    RequestOffloadState,
    SchedulerOffloadConfig,
)
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload import config as vc
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from jax_kvoffload.bridge import vllm as bridge
from jax_kvoffload.errors import KVOffloadError

TOKENS_PER_HASH = 16
PAGE = 4096  # worker KV bytes per block: one host page, so a chunk row is bpc pages


class Divergence(AssertionError):
    """Our manager answered differently from vLLM's."""


def _plain(value: Any) -> Any:
    """A comparable form of a policy hook argument."""
    if isinstance(value, base.ReqContext):
        return ("ctx", value.req_id)
    if isinstance(value, (set, frozenset)):
        return ("set", sorted(value))
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "chunk_id"):  # ours or vLLM's ChunkStatus
        return ("chunk", value.chunk_id, value.ref_cnt)
    return value


class _Recorder:
    """Logs every hook call vLLM's manager makes on its policy (not the pure `get`)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)  # type: ignore[call-arg]
        self.calls: list[Any] = []

    def _log(self, *call: Any) -> None:
        self.calls.append(_plain(call))

    def insert(self, key, chunk, req_context):
        self._log("insert", key, chunk, req_context)
        super().insert(key, chunk, req_context)  # type: ignore[misc]

    def remove(self, key):
        self._log("remove", key)
        super().remove(key)  # type: ignore[misc]

    def touch(self, keys, req_context):
        self._log("touch", list(keys), req_context)
        super().touch(keys, req_context)  # type: ignore[misc]

    def on_store_miss(self, keys, req_context):
        self._log("on_store_miss", list(keys), req_context)
        super().on_store_miss(keys, req_context)  # type: ignore[misc]

    def on_request_access(self, keys, req_context):
        self._log("on_request_access", list(keys), req_context)
        super().on_request_access(keys, req_context)  # type: ignore[misc]

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        self._log("on_request_finished", key_groups, insertion_only_keys, reused_keys, req_context)
        super().on_request_finished(  # type: ignore[misc]
            key_groups, insertion_only_keys, reused_keys, req_context
        )

    def evict(self, n, protected):
        victims = super().evict(n, protected)  # type: ignore[misc]
        self._log("evict", n, protected, victims)
        return victims

    def clear(self):
        self._log("clear")
        super().clear()  # type: ignore[misc]

    def mark_evictable(self, key):
        self._log("mark_evictable", key)
        super().mark_evictable(key)  # type: ignore[misc]

    def mark_non_evictable(self, key):
        self._log("mark_non_evictable", key)
        super().mark_non_evictable(key)  # type: ignore[misc]


class RecordingLRUCachePolicy(_Recorder, LRUCachePolicy):
    """vLLM's LRU policy, logging its calls: a custom policy written for vLLM."""


class RecordingARCCachePolicy(_Recorder, ARCCachePolicy):
    """vLLM's ARC policy, logging its calls: a custom policy written for vLLM."""


# Registered with vLLM's factory only: our store must find them there (via the bridge).
REGISTERED = {
    "diff-recording-lru": "RecordingLRUCachePolicy",
    "diff-recording-arc": "RecordingARCCachePolicy",
}
for _name, _cls in REGISTERED.items():
    with contextlib.suppress(ValueError):  # registered by an earlier import
        CachePolicyFactory.register_cache_policy(_name, __name__, _cls)


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """One trace's geometry and manager settings (all drawn from the seed)."""

    seed: int
    policy: str
    blocks_per_chunk: int
    tokens_per_block: tuple[int, ...]  # per group
    windows: tuple[int | None, ...]  # sliding_window_size_in_chunks per group
    num_chunks: int
    store_threshold: int
    max_tracker_size: int
    num_calls: int
    cache_policy_module_path: str | None = None

    @classmethod
    def draw(cls, seed: int) -> TraceConfig:
        """One trace in three runs a vLLM-style policy: registered with vLLM's factory,
        or loaded from `cache_policy_module_path` (its hook calls are compared too)."""
        rng = random.Random(seed)
        kind = rng.choice(("lru", "arc", "lru", "arc", "registered", "module"))
        policy, module_path = kind, None
        if kind == "registered":
            policy = rng.choice(sorted(REGISTERED))
        elif kind == "module":
            policy, module_path = rng.choice(sorted(REGISTERED.values())), __name__
        num_groups = rng.randint(1, 3)
        tpb = tuple(TOKENS_PER_HASH * rng.choice((1, 1, 2)) for _ in range(num_groups))
        # Group 0 is full attention (as in every hybrid model); others may be windowed.
        others = [None if rng.random() < 0.4 else rng.randint(1, 3) for _ in range(num_groups - 1)]
        windows = (None, *others)
        return cls(
            seed=seed,
            policy=policy,
            blocks_per_chunk=rng.randint(1, 4),
            tokens_per_block=tpb,
            windows=windows,
            num_chunks=rng.randint(4, 32),
            store_threshold=rng.choice((0, 0, 0, 1, 2, 3)),
            max_tracker_size=rng.choice((64_000, rng.randint(1, 48))),
            num_calls=rng.randint(150, 450),
            cache_policy_module_path=module_path,
        )

    def offloading_config(self) -> vc.OffloadingConfig:
        extra: dict[str, Any] = {
            "spec_name": "JaxOffloadingSpec",
            "spec_module_path": "jax_kvoffload.bridge.vllm",
            "cpu_bytes_to_use": self.num_chunks * PAGE * self.blocks_per_chunk,
            "eviction_policy": self.policy,
            "store_threshold": self.store_threshold,
            "max_tracker_size": self.max_tracker_size,
        }
        if self.cache_policy_module_path is not None:
            extra["cache_policy_module_path"] = self.cache_policy_module_path
        return vc.OffloadingConfig(
            groups=tuple(
                vc.OffloadingGroupConfig(tpb, (f"layer{g}",), g, window)
                for g, (tpb, window) in enumerate(zip(self.tokens_per_block, self.windows))
            ),
            worker_kv_bytes_per_block=PAGE,
            enable_kv_cache_events=True,
            extra_config=extra,
            engine_id="diff-engine",
            model=vc.OffloadingModelConfig("m", "float16", 0),
            cache=vc.OffloadingCacheConfig(TOKENS_PER_HASH, self.blocks_per_chunk),
            parallel=vc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        )

    def scheduler_config(self) -> SchedulerOffloadConfig:
        """The slice of vLLM's `SchedulerOffloadConfig` that keys requests."""
        groups = tuple(
            GroupOffloadConfig(
                group_idx=g,
                tokens_per_block=tpb,
                tokens_per_chunk=tpb * self.blocks_per_chunk,
                hashes_per_chunk=tpb * self.blocks_per_chunk // TOKENS_PER_HASH,
                kv_event_group_spec=None,
                sliding_window_size_in_chunks=window,
                kv_cache_spec=None,
                manager_cls=None,
            )
            for g, (tpb, window) in enumerate(zip(self.tokens_per_block, self.windows))
        )
        return SchedulerOffloadConfig(
            kv_group_configs=groups,
            blocks_per_chunk=self.blocks_per_chunk,
            tokens_per_hash=TOKENS_PER_HASH,
            num_workers=1,
            offload_prompt_only=True,
            supports_partial_tail=False,
        )


class _Request:
    """One engine request, seen by both managers through their own `ReqContext`."""

    def __init__(self, req_id: str, hashes: list[bytes], sched: SchedulerOffloadConfig):
        self.req = types.SimpleNamespace(
            request_id=req_id, block_hashes=list(hashes), kv_transfer_params=None
        )
        self.states = [
            RequestOffloadState(sched, self.req, base.ReqContext(req_id), None) for _ in range(2)
        ]
        self.finished = False
        self.stored = [0] * len(sched.kv_group_configs)  # next chunk to offer, per group
        self.rekey()

    def rekey(self) -> None:
        for state in self.states:
            state.update_offload_keys()
        ours, theirs = self.states
        assert [g.offload_keys for g in ours.group_states] == [
            g.offload_keys for g in theirs.group_states
        ]

    @property
    def contexts(self) -> tuple[base.ReqContext, base.ReqContext]:
        return self.states[0].req_context, self.states[1].req_context

    def keys(self, group: int) -> list[bytes]:
        return self.states[1].group_states[group].offload_keys


def _normalize(value: Any) -> Any:
    """A comparable, printable form of a manager answer."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if isinstance(value, base.LookupResult):
        return ("LookupResult", value.name)
    if isinstance(value, base.PrepareStoreOutput):
        return (
            "PrepareStoreOutput",
            list(value.keys_to_store),
            _normalize(value.store_spec),
            list(value.evicted_keys),
        )
    if isinstance(value, base.LoadStoreSpec):
        return (type(value).__name__, value.block_ids.dtype.str, value.block_ids.tolist())
    if isinstance(value, base.OffloadingEvent):
        fields = [getattr(value, f.name) for f in dataclasses.fields(value)]
        return ("OffloadingEvent", list(value.keys), *fields[1:])
    if isinstance(value, base.RequestOffloadingContext):
        return ("RequestOffloadingContext", value.policy)
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if hasattr(value, "data") and hasattr(value, "observe_histogram"):  # connector stats
        # vLLM's metrics only: the plug-in's own (vllm:kv_offload_jax_*) have no twin.
        types, data = value.data["types"], value.data["data"]
        keep = [n for n in data if not n.startswith("vllm:kv_offload_jax_")]
        kept = {n: (types[n], data[n]) for n in keep}
        return ("OffloadingConnectorStats", kept, set(types) - set(data), value.data["info"])
    raise TypeError(f"cannot compare {value!r}")


def error_family(exc: BaseException, ours: bool) -> str:
    """vLLM asserts on protocol misuse; we raise typed errors of our root instead."""
    if ours:
        if isinstance(exc, KVOffloadError) and isinstance(exc, (ValueError, RuntimeError)):
            return "protocol"
        return f"untyped {type(exc).__name__}"
    return "protocol" if isinstance(exc, AssertionError) else f"vllm {type(exc).__name__}"


class Twins:
    """Our manager and vLLM's, built from one config, answering every call alike."""

    def __init__(self, cfg: TraceConfig, coverage: collections.Counter | None = None):
        offloading_config = cfg.offloading_config()
        self.ours = bridge.JaxOffloadingSpec(offloading_config).get_manager()
        self.theirs = CPUOffloadingSpec(offloading_config).get_manager()
        self.cfg = cfg
        self.log: list[tuple[str, tuple[Any, ...], str | None]] = []
        self.coverage = collections.Counter() if coverage is None else coverage
        # A vLLM-style policy logs its hook calls: both logs must stay equal.
        self.policies = (self.ours.store.policy, self.theirs._policy)
        self.recorded = isinstance(self.policies[1], _Recorder)
        if self.recorded and type(self.policies[0]) is not type(self.policies[1]):
            self.fail(f"policies differ: {self.policies}")
        self.coverage["traces"] += 1
        self.coverage[f"policy {type(self.policies[1]).__name__}"] += 1
        # Our extra metrics (vllm:kv_offload_jax_*), modelled from vLLM's answers: the
        # increments of all our payloads must add up to them at every get_stats.
        self.expected: collections.Counter = collections.Counter()
        self.reported: collections.Counter = collections.Counter()

    def fail(self, message: str) -> None:
        tail = "\n  ".join(f"{m}{_short(a)} req={r}" for m, a, r in self.log[-12:])
        raise Divergence(
            f"seed={self.cfg.seed} call #{len(self.log)}: {message}\n"
            f"config: {self.cfg}\nlast calls:\n  {tail}\n"
            f"replay: JKO_MANAGER_DIFF_SEED={self.cfg.seed} "
            "python -m pytest -q tests/bridge/test_vllm_manager_diff.py"
        )

    def call(self, method: str, *args: Any, req: _Request | None = None, **kw: Any) -> Any:
        """Calls `method` on both (each with its own context); returns vLLM's answer.

        Raises `_Stop` when both raise an error of the same family: vLLM asserts
        midway (state half-changed) where we are all or nothing, so a trace ends there.
        """
        self.log.append((method, args, req and req.req.request_id))
        out, errors = [], []
        for side, manager in enumerate((self.ours, self.theirs)):
            ctx_args = () if req is None else (req.contexts[side],)
            try:
                value = getattr(manager, method)(*args, *ctx_args, **kw)
                if method == "take_events":
                    value = list(value)
                out.append(value)
                errors.append(None)
            except Exception as exc:  # compared by family below
                out.append(None)
                errors.append(exc)
        if errors != [None, None]:
            families = [
                None if e is None else error_family(e, ours=(i == 0)) for i, e in enumerate(errors)
            ]
            if families[0] != families[1] or families[0] != "protocol":
                self.fail(f"{method}: errors differ: ours {errors[0]!r}, vLLM {errors[1]!r}")
            self.coverage[f"{method} error"] += 1
            raise _Stop
        ours, theirs = (_normalize(v) for v in out)
        if ours != theirs:
            self.fail(f"{method} answers differ:\n  ours:  {ours}\n  vLLM:  {theirs}")
        if self.recorded:
            calls = [p.calls for p in self.policies]
            if calls[0] != calls[1]:
                same = (i for i, (a, b) in enumerate(zip(*calls)) if a != b)
                n = next(same, min(len(c) for c in calls))
                self.fail(
                    f"{method}: the policy heard different calls (from hook call #{n}):\n"
                    f"  ours:  {calls[0][n : n + 3]}\n  vLLM:  {calls[1][n : n + 3]}"
                )
            self.coverage["policy hook calls"] += len(calls[1])
            for p in self.policies:
                p.calls.clear()
        self._count(method, out[1], kw)
        self._check_our_metrics(method, out)
        return out[1]

    def _check_our_metrics(self, method: str, out: list[Any]) -> None:
        if method == "lookup":  # vLLM's answer: LookupResult.HIT / HIT_PENDING / MISS
            self.expected[("vllm:kv_offload_jax_chunk_lookups", (out[1].name.lower(),))] += 1
        elif method == "prepare_store" and out[1] is not None:
            self.expected[("vllm:kv_offload_jax_chunk_evictions", ())] += len(out[1].evicted_keys)
        elif method == "get_stats":
            for name, values in out[0].data["data"].items():
                if name.startswith("vllm:kv_offload_jax_chunk_"):
                    for labels, value in values.items():
                        self.reported[(name, labels)] += value
            got = {k: v for k, v in self.reported.items() if "_stores" not in k[0]}
            want = {k: v for k, v in self.expected.items() if v}
            if got != want:
                self.fail(f"our metrics: sent {got}, vLLM's answers imply {want}")

    def _count(self, method: str, value: Any, kw: dict[str, Any]) -> None:
        """What the traces reached (the test asserts each outcome occurs)."""
        c = self.coverage
        c[f"{method}"] += 1
        if method == "lookup":
            c[f"lookup {value.name}"] += 1
        elif method == "prepare_store":
            if value is None:
                c["prepare_store None"] += 1
            elif value.evicted_keys:
                c["prepare_store evicted"] += 1
            elif not value.keys_to_store:
                c["prepare_store nothing to store"] += 1
        elif method == "complete_store" and not kw.get("success", True):
            c["complete_store failed"] += 1
        elif method == "take_events":
            c["metadata-only events"] += sum(e.metadata_only for e in value)
        elif method == "get_stats":
            data = value.data["data"]
            if data.get("vllm:kv_offload_stores_skipped", {}).get((), 0):
                c["stores skipped"] += 1


class _Stop(Exception):
    """Both managers refused a call alike; the trace ends."""


def _short(args: tuple[Any, ...]) -> str:
    def one(a: Any) -> str:
        if isinstance(a, bytes):
            return a[:3].hex() + ".." + a[-1:].hex()
        if isinstance(a, list):
            return "[" + ",".join(one(x) for x in a) + "]"
        return repr(a)

    return "(" + ", ".join(one(a) for a in args) + ")"


class TraceRunner:
    """Draws one random trace from `cfg.seed` and runs it on `Twins`."""

    def __init__(self, cfg: TraceConfig, coverage: collections.Counter | None = None):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed * 7919 + 1)
        self.twins = Twins(cfg, coverage)
        self.sched = cfg.scheduler_config()
        # A few long prompts; requests take a prefix of one plus a private tail.
        self.prompts = [[self._hash() for _ in range(self.rng.randint(8, 40))] for _ in range(4)]
        self.requests: list[_Request] = []
        self.loads: list[tuple[_Request, list[bytes]]] = []
        self.stores: list[tuple[_Request, list[bytes]]] = []
        self.next_req = 0
        # One trace in ten misuses the protocol now and then (it ends at the first error).
        self.misuse = 0.03 if self.rng.random() < 0.1 else 0.0

    def _hash(self) -> bytes:
        return self.rng.randbytes(self.rng.choice((8, 32)))

    def run(self) -> int:
        """Runs the trace; returns the number of calls made."""
        ops = [
            (self.new_request, 3),
            (self.grow, 2),
            (self.lookup_and_load, 6),
            (self.complete_load, 4),
            (self.touch, 2),
            (self.store, 8),
            (self.complete_store, 7),
            (self.take_events, 2),
            (self.stats, 1),
            (self.finish, 3),
            (self.reset, 0.25),
            (self.lone_call, 0.5),
        ]
        funcs, weights = zip(*ops)
        try:
            while len(self.twins.log) < self.cfg.num_calls:
                self.rng.choices(funcs, weights)[0]()
            self.take_events()
            self.stats()
        except _Stop:
            pass
        ours, theirs = self.twins.policies
        if hasattr(theirs, "target_t1_size"):  # ARC: the adaptation must agree too
            if ours.target_t1_size != theirs.target_t1_size:
                self.twins.fail(
                    f"ARC targets differ: {ours.target_t1_size}, {theirs.target_t1_size}"
                )
            self.twins.coverage["arc target moved"] += theirs.target_t1_size > 0
        return len(self.twins.log)

    # --- helpers ---

    def _live(self) -> list[_Request]:
        return [r for r in self.requests if not r.finished]

    def _pick(self, requests: list[_Request]) -> _Request | None:
        return self.rng.choice(requests) if requests else None

    def _lookup(self, req: _Request, key: bytes) -> base.LookupResult:
        return self.twins.call("lookup", key, req=req)

    # --- operations ---

    def new_request(self) -> None:
        if len(self._live()) >= 6:
            return
        prompt = self.rng.choice(self.prompts)
        hashes = prompt[: self.rng.randint(0, len(prompt))]
        hashes += [self._hash() for _ in range(self.rng.randint(0, 12))]
        req = _Request(f"req-{self.next_req}", hashes, self.sched)
        self.next_req += 1
        self.requests.append(req)
        if self.rng.random() < 0.9:  # vLLM always calls it; the manager must not need it
            self.twins.call("on_new_request", req=req)

    def grow(self) -> None:
        req = self._pick(self._live())
        if req is not None:
            req.req.block_hashes.extend(self._hash() for _ in range(self.rng.randint(1, 6)))
            req.rekey()

    def lookup_and_load(self) -> None:
        """The scheduler's prefix lookup: keys head first until a miss; load the hits."""
        req = self._pick(self._live())
        if req is None:
            return
        to_load = []
        for g, window in enumerate(self.cfg.windows):
            keys = req.keys(g)
            if window is not None:  # a window group needs only its trailing chunks
                keys = keys[-window - self.rng.randint(0, 1) :]
            for key in keys:
                result = self._lookup(req, key)
                if result is base.LookupResult.HIT:
                    self.twins.call("get_load_source", key, req=req)
                    to_load.append(key)
                elif result is not base.LookupResult.HIT_PENDING:
                    break
        if self.rng.random() < self.misuse:  # a key that is not loadable
            to_load.append(self.rng.choice(self.prompts)[0] + b"\0\0\0\x09")
        if to_load and self.rng.random() < 0.8:
            if self.rng.random() < 0.05:
                to_load.append(to_load[0])  # a key pinned twice by one job
            self.twins.call("prepare_load", list(to_load), req=req)
            self.loads.append((req, to_load))

    def complete_load(self) -> None:
        if not self.loads:
            return
        req, keys = self.loads.pop(self.rng.randrange(len(self.loads)))
        self.twins.call("complete_load", keys, req=req)
        if self.rng.random() < self.misuse:  # once too often
            self.twins.call("complete_load", keys, req=req)

    def touch(self) -> None:
        req = self._pick(self.requests)
        if req is None:
            return
        keys = [k for g in range(len(self.cfg.windows)) for k in req.keys(g)]
        if keys:
            start = self.rng.randrange(len(keys))
            self.twins.call("touch", keys[start : start + self.rng.randint(1, 6)], req=req)

    def store(self) -> None:
        """One `prepare_store` per request and step: the next chunks of every group."""
        req = self._pick(self._live())
        if req is None:
            return
        offered = []
        for g, window in enumerate(self.cfg.windows):
            keys = req.keys(g)
            start = req.stored[g]
            if self.rng.random() < 0.15:  # a REQUEST_LEVEL-like re-offer from the head
                start = self.rng.randint(0, start)
            end = min(len(keys), start + self.rng.randint(1, 5))
            if window is not None:  # only chunks inside the window are reachable
                start = max(start, end - window)
            offered += keys[start:end]
            req.stored[g] = max(req.stored[g], end)
        if self.rng.random() < 0.03 and offered:
            offered.append(offered[-1])  # vLLM does not deduplicate an offer
        if not offered and self.rng.random() < 0.7:
            return
        out = self.twins.call("prepare_store", offered, req=req)
        if out is not None and out.keys_to_store:
            self.stores.append((req, list(out.keys_to_store)))

    def complete_store(self) -> None:
        if not self.stores:
            return
        req, keys = self.stores.pop(self.rng.randrange(len(self.stores)))
        if self.rng.random() < 0.1:  # extra keys (ready, absent) are ignored
            keys = keys + [k for k in req.keys(0)[:2]]
        self.twins.call("complete_store", keys, req=req, success=self.rng.random() < 0.8)

    def take_events(self) -> None:
        self.twins.call("take_events")

    def stats(self) -> None:
        self.twins.call("get_stats")

    def finish(self) -> None:
        req = self._pick(self.requests)
        if req is None:
            return
        self.twins.call("on_request_finished", req=req)
        req.finished = True
        busy = {id(r) for r, _ in self.loads + self.stores}
        self.requests = [r for r in self.requests if not r.finished or id(r) in busy]

    def reset(self) -> None:
        # vLLM's scheduler fences every job prepared before a reset: none completes.
        self.twins.call("reset_cache")
        self.loads.clear()
        self.stores.clear()

    def lone_call(self) -> None:
        """A call on a context that never saw `on_new_request` (or on a finished one)."""
        req = self._pick(self.requests)
        if req is not None and req.finished and req.keys(0):
            # Finished requests may still be offered keys they saw; new keys fail alike.
            seen = req.keys(0)[: req.stored[0]]
            if seen:
                self.twins.call("prepare_store", seen[:2], req=req)
