"""A minimal engine step loop that drives a connector's two roles as vLLM 0.33.0 does.

One scheduler-role and one worker-role instance of the connector under test, one
runner, one block pool. Per step it makes the calls vLLM's `Scheduler` and the runner's
`KVConnectorModelRunnerMixin._get_kv_connector_output` make, in their order:

    scheduler: get_num_new_matched_tokens -> (allocate) update_state_after_alloc
               -> build_connector_meta(SchedulerOutput)
    worker:    bind_connector_metadata -> start_load_kv (synchronous loads: before the
               forward, as `has_sync_kv_loads` makes vLLM do) -> forward -> wait_for_save
               -> get_finished -> get_kv_connector_stats -> clear_connector_metadata
    scheduler: update_connector_output(KVConnectorOutput(...))

The "forward" writes each computed block's KV (finite values, `random_values`) as a
function of its block hash (the hash covers the whole prefix, as the model's KV depends
on it), so a load is right exactly when a block holds `content(hash)`. Freed blocks are
overwritten with noise, so nothing left in HBM can pass for a load. Requests are real
vLLM `Request`s hashed with vLLM's `get_request_block_hasher` (sha256): the keys are the
engine's content hashes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from tests.tpu_inference._their_stack import Runner, bits, make_caches, random_values

SAVE_TIMEOUT_S = 120.0


@dataclass
class _Blocks:
    """The `KVCacheBlocks` surface `update_state_after_alloc` reads."""

    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


@dataclass
class Prefill:
    """What one prefill step reported and delivered."""

    matched_tokens: int  # what get_num_new_matched_tokens told vLLM
    load_blocks: list[int]  # dst blocks of the step's load specs
    loaded_right: list[bool]  # per loaded block: every layer holds content(hash)
    saved_chunks: int  # chunks the step's saves reported done (stats)
    loaded_chunks: int  # chunks the step's loads reported done (stats)


class MiniEngine:
    def __init__(self, connector_cls, config, m, spec, shape, dtype, layers, seed=7):
        init_none_hash(sha256)
        self.block_size = config.cache_config.block_size
        self.hasher = get_request_block_hasher(self.block_size, sha256)
        self.scheduler = connector_cls(config, KVConnectorRole.SCHEDULER)
        self.worker = connector_cls(config, KVConnectorRole.WORKER)
        self.sharding = NamedSharding(m, spec)
        self.shape, self.dtype, self.layers = shape, dtype, layers
        caches, _ = make_caches(m, spec, [shape] * layers, dtype, seed)
        self.runner = Runner(caches, m)
        self.worker.register_runner(self.runner)
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(shape[0])]
        self.owned: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}
        self._noise = seed

    # -- the model's KV, as a function of the prefix ---------------------------------

    def content(self, key: bytes, layer: int) -> np.ndarray:
        seed = [*key[:16], layer]
        return random_values(self.shape[1:], self.dtype, np.random.SeedSequence(seed))

    def _write(self, pages: dict[int, list[np.ndarray]]) -> None:
        if not pages:
            return
        host = [np.asarray(c).copy() for c in self.runner.kv_caches]
        for block, per_layer in pages.items():
            for layer, page in enumerate(per_layer):
                host[layer][block] = page
        self.runner.kv_caches = [jax.device_put(h, self.sharding) for h in host]

    def _forward(self, req: Request, ids: list[int], start_token: int) -> None:
        hashes = req.block_hashes
        pages = {}
        for i in range(start_token // self.block_size, len(ids)):
            key = bytes(hashes[i]) if i < len(hashes) else f"{req.request_id}/{i}".encode()
            pages[ids[i]] = [self.content(key, layer) for layer in range(self.layers)]
        self._write(pages)

    def _check(self, req: Request, ids: list[int], blocks: list[int]) -> list[bool]:
        host = [bits(c) for c in self.runner.kv_caches]
        right = []
        for block in blocks:
            key = bytes(req.block_hashes[ids.index(block)])
            want = [bits(self.content(key, layer)) for layer in range(self.layers)]
            right.append(all(np.array_equal(host[i][block], w) for i, w in enumerate(want)))
        return right

    # -- steps -------------------------------------------------------------------------

    def new_request(self, request_id: str, tokens: list[int]) -> Request:
        params = SamplingParams(max_tokens=8)
        req = Request(request_id, tokens, params, None, block_hasher=self.hasher)
        self.requests[request_id] = req
        return req

    def prefill(self, req: Request) -> Prefill:
        """Schedules the whole prompt in one step (loads first, then the forward)."""
        rid, bs = req.request_id, self.block_size
        matched, load_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        if load_async:
            raise AssertionError(f"{rid}: asynchronous loads are not what this engine drives")
        ids = [self.free.pop() for _ in range(-(-req.num_tokens // bs))]
        self.owned[rid] = ids
        self.scheduler.update_state_after_alloc(req, _Blocks(ids), matched)
        req.num_computed_tokens = matched
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(req, (ids,))]
        out.num_scheduled_tokens = {rid: req.num_tokens - matched}
        out.total_num_scheduled_tokens = req.num_tokens - matched
        out.has_sync_kv_loads = matched > 0
        meta = self._begin(out)
        loads = [b for m in meta.requests_meta if m.load_spec for b in m.load_spec.dst_blocks]
        loaded_right = self._check(req, ids, loads)
        self._forward(req, ids, matched)
        saved, loaded = self._end(out, _saves(meta))
        req.num_computed_tokens = req.num_tokens
        return Prefill(matched, loads, loaded_right, saved, loaded)

    def finish(self, req: Request) -> None:
        """The request ends: its last step (the final, empty save), then its blocks are
        freed and overwritten with noise."""
        rid = req.request_id
        out = SchedulerOutput.make_empty()
        out.finished_req_ids = {rid}
        self._end(out, _saves(self._begin(out)))
        self.scheduler.request_finished(req, self.owned[rid])
        ids = self.owned.pop(rid)
        self._noise += 1
        noise = random_values((len(ids), self.layers, *self.shape[1:]), self.dtype, self._noise)
        self._write({b: list(noise[i]) for i, b in enumerate(ids)})
        self.free.extend(ids)

    def _begin(self, out: SchedulerOutput):
        """A step up to the forward: the scheduler's metadata, bound; the loads."""
        meta = self.scheduler.build_connector_meta(out)
        out.kv_connector_metadata = meta
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        return meta

    def _end(self, out: SchedulerOutput, expected_saves: int) -> tuple[int, int]:
        """The rest of the step, then empty steps until every save the step started has
        been reported (saves end on a worker thread). Returns (saved, loaded) chunks."""
        saved = loaded = 0
        deadline = time.monotonic() + SAVE_TIMEOUT_S
        while True:
            self.worker.wait_for_save()
            sending, recving = self.worker.get_finished(out.finished_req_ids)
            stats = self.worker.get_kv_connector_stats()
            self.worker.clear_connector_metadata()
            if stats is not None and stats.data:
                saved += sum(len(v) for v in stats.data["finished_save_chunks"].values())
                loaded += sum(len(v) for v in stats.data["finished_load_chunks"].values())
            output = KVConnectorOutput(
                finished_sending=sending or set(),
                finished_recving=recving or set(),
                kv_connector_stats=stats,
            )
            self.scheduler.update_connector_output(output)
            if saved >= expected_saves:
                return saved, loaded
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expected_saves} chunk saves started, {saved} reported")
            time.sleep(0.01)
            out = SchedulerOutput.make_empty()
            self._begin(out)


def _saves(meta) -> int:
    return sum(len(m.save_spec.dst_chunks) for m in meta.requests_meta if m.save_spec)
