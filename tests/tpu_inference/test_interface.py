"""What we depend on in tpu-inference 0.32.0, checked on its installed sources.

Our connector (`jax_kvoffload.bridge.tpu_inference`, docs/tpu_inference.md) keeps their
scheduler, their metadata types and their runner hook, and replaces their host backend
and worker data path. Each name below is one it relies on; when tpu-inference moves
one, the test names the file, the class or function and what changed. The sources are
read, not imported (importing tpu-inference rewrites this process's `XLA_FLAGS`), so
these checks also cover modules that cannot be imported here (their runner).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import pathlib
from functools import cache

import pytest

from tests.tpu_inference.test_harness import _missing

pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

PINNED = "0.32.0"

# (file, class) -> methods and their leading parameter names (after self / cls).
METHODS = {
    ("offload/tpu_offload_connector.py", "TPUOffloadConnector"): {
        "__init__": ["vllm_config", "role", "kv_cache_config"],
        "get_required_kvcache_layout": ["vllm_config"],
        "build_kv_connector_stats": ["data"],
        "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
        "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
        "build_connector_meta": ["scheduler_output"],
        "request_finished": ["request", "block_ids"],
        "register_runner": ["runner"],
        "start_load_kv": ["fwd_ctx"],
        "wait_for_save": [],
        "get_finished": ["finished_req_ids"],
        "update_connector_output": ["connector_output"],
        "get_kv_connector_stats": [],
    },
    ("offload/tpu_offload_connector.py", "TPUOffloadConnectorScheduler"): {
        "__init__": ["vllm_config"],
        "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
        "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
        "build_connector_meta": ["scheduler_output"],
        "update_connector_output": ["connector_output"],
        "request_finished": ["request", "block_ids"],
    },
    ("offload/tpu_offload_connector.py", "TPUOffloadConnectorWorker"): {
        "__init__": ["vllm_config", "connector"],
        "register_runner": ["runner"],
        "start_save_kv": [],
        "start_load_kv": ["fwd_ctx"],
        "get_kv_connector_stats": [],
        "get_finished": [],
    },
    ("offload/tpu_offload_connector.py", "KVOffloadConnectorStats"): {
        "record_save": ["req", "saved_chunk_ids"],
        "record_load": ["req", "loaded_chunk_ids"],
        "clone_and_reset": [],
        "aggregate": ["other"],
        "is_empty": [],
    },
    # The scheduler's manager: the seam our HostStore adapter fills.
    ("offload/offload_manager.py", "LRUCacheManager"): {
        "__init__": ["num_cpu_chunks"],
        "lookup": ["chunk_hashes"],
        "touch": ["chunk_hashes"],
        "allocate_for_save": ["chunk_hashes"],
        "prepare_load": ["chunk_hashes"],
        "complete_save": ["chunk_hashes"],
        "complete_load": ["chunk_hashes"],
        "mark_completion": ["chunk_ids", "operation"],
    },
    # Their host backend (what our worker replaces; the benchmark's baseline).
    ("offload/cpu_backend.py", "LocalCPUBackend"): {
        "__init__": ["num_cpu_chunks"],
        "add": ["chunk_id", "value"],
        "get": ["chunk_id"],
        "reclaim_unoccupied_chunks": ["occupied_chunk_ids"],
    },
    ("runner/tpu_runner.py", "TPUModelRunner"): {"get_kv_cache_layout": []},
}

# Dataclasses whose fields (in order) our scheduler emits and our worker reads.
FIELDS = {
    "SaveSpec": [
        "num_skip_leading_tokens",
        "num_total_tokens",
        "src_blocks",
        "dst_chunks",
        "is_final_save",
        "skip_save",
    ],
    "LoadSpec": [
        "num_matched_tokens",
        "src_chunks",
        "dst_blocks",
        "can_load",
        "num_skip_leading_tokens",
    ],
    "TPUReqMeta": ["req_id", "token_ids", "local_block_ids", "save_spec", "load_spec"],
    "TPUOffloadConnectorMetadata": ["requests_meta"],
}

# The scheduler reaches its manager only through these calls (our adapter implements them).
MANAGER_CALLS = {"lookup", "touch", "allocate_for_save", "prepare_load", "mark_completion"}
# What their worker reads of a runner (tests/tpu_inference/_their_stack.Runner provides it).
RUNNER_READS = {"kv_caches", "devices", "mesh", "get_kv_cache_layout"}
ADMITTED = ("TPUConnector", "TPUConnectorHMA", "TPUOffloadConnector", "RaidenOffloadConnector")


@cache
def package_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("tpu_inference")  # top-level: finds, does not import
    assert spec is not None and spec.submodule_search_locations
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


@cache
def tree(relpath: str) -> ast.Module:
    return ast.parse((package_dir() / relpath).read_text(), filename=relpath)


def find(node: ast.AST, kind: type, name: str, where: str) -> ast.AST:
    for child in ast.walk(node):
        if isinstance(child, kind) and child.name == name:
            return child
    pytest.fail(f"tpu-inference {where}: no {kind.__name__} {name!r} any more")


def params(fn: ast.FunctionDef) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return names[1:] if names and names[0] in ("self", "cls") else names


def attribute_uses(node: ast.AST, owner: str) -> set[str]:
    """Attributes read off `owner` (a name, or `self.<owner>`) anywhere under `node`."""
    found = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Attribute):
            base = child.value
            if (isinstance(base, ast.Name) and base.id == owner) or (
                isinstance(base, ast.Attribute)
                and base.attr == owner
                and isinstance(base.value, ast.Name)
                and base.value.id == "self"
            ):
                found.add(child.attr)
    return found


def test_the_installed_version_is_the_pinned_one():
    """The checks below were read off 0.32.0; another version may pass them and still
    differ (docs/tpu_inference.md says what to re-read)."""
    assert importlib.metadata.version("tpu-inference") == PINNED


@pytest.mark.parametrize(("where", "methods"), METHODS.items(), ids=lambda v: str(v))
def test_classes_and_methods_we_call(where, methods):
    relpath, cls_name = where
    cls = find(tree(relpath), ast.ClassDef, cls_name, relpath)
    for name, expected in methods.items():
        fn = find(cls, ast.FunctionDef, name, f"{relpath} {cls_name}")
        got = params(fn)
        assert got[: len(expected)] == expected, (
            f"tpu-inference {relpath} {cls_name}.{name}: parameters {got}, we call it "
            f"with {expected}"
        )


@pytest.mark.parametrize(("cls_name", "fields"), FIELDS.items())
def test_metadata_dataclasses(cls_name, fields):
    cls = find(tree("offload/tpu_offload_connector.py"), ast.ClassDef, cls_name, "connector")
    got = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)]
    assert got == fields, f"tpu-inference {cls_name} fields are now {got}, we use {fields}"


def test_the_scheduler_reaches_its_manager_only_through_the_seam():
    relpath = "offload/tpu_offload_connector.py"
    cls = find(tree(relpath), ast.ClassDef, "TPUOffloadConnectorScheduler", relpath)
    init = find(cls, ast.FunctionDef, "__init__", relpath)
    assigned = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "offload_manager" for t in n.targets)
    ]
    assert assigned, "TPUOffloadConnectorScheduler.__init__ no longer sets self.offload_manager"
    used = attribute_uses(cls, "offload_manager")
    assert used == MANAGER_CALLS, (
        f"the scheduler now uses offload_manager.{sorted(used - MANAGER_CALLS)} and no "
        f"longer {sorted(MANAGER_CALLS - used)}; our HostStore adapter implements "
        f"{sorted(MANAGER_CALLS)}"
    )
    # mark_completion resolves chunk ids through the pool's id -> hash map.
    manager = find(tree("offload/offload_manager.py"), ast.ClassDef, "LRUCacheManager", "")
    assert "allocated_id_to_hash_map" in attribute_uses(manager, "chunk_pool")


def test_what_the_worker_reads_of_the_runner():
    relpath = "offload/tpu_offload_connector.py"
    cls = find(tree(relpath), ast.ClassDef, "TPUOffloadConnectorWorker", relpath)
    register = find(cls, ast.FunctionDef, "register_runner", relpath)
    assert attribute_uses(register, "runner") == RUNNER_READS
    assert attribute_uses(cls, "runner") == RUNNER_READS, "the worker reads more of its runner"


def test_the_runner_hands_its_caches_to_any_connector():
    """`register_runner(self)` on whatever connector vLLM built (not only theirs)."""
    runner = find(tree("runner/tpu_runner.py"), ast.ClassDef, "TPUModelRunner", "runner")
    calls = [
        n
        for n in ast.walk(runner)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "register_runner"
        and isinstance(n.func.value, ast.Call)
        and getattr(n.func.value.func, "id", None) == "get_kv_transfer_group"
    ]
    assert calls, "TPUModelRunner no longer calls get_kv_transfer_group().register_runner(self)"


def test_the_platform_admits_connectors_by_class_name():
    relpath = "platforms/tpu_platform.py"
    fn = find(tree(relpath), ast.FunctionDef, "check_and_update_config", relpath)
    tuples = [
        tuple(e.value for e in n.value.elts)
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "allowed" for t in n.targets)
        and isinstance(n.value, ast.Tuple)
    ]
    assert tuples == [ADMITTED], f"the TPU platform now admits {tuples}"


def test_their_worker_reserves_staging_hbm_only_for_their_module_path():
    """tpu_worker.determine_available_memory subtracts the offload staging buffer (and
    starts their stats logger) only when kv_connector_module_path is *their* module:
    a connector loaded from ours gets neither (docs/tpu_inference.md, "Limits")."""
    text = (package_dir() / "worker/tpu_worker.py").read_text()
    assert text.count('== "tpu_inference.offload.tpu_offload_connector"') == 2


def test_the_kv_cache_layout_we_gather():
    """Their RPA v3 shape and its sharding, as docs/tpu_inference.md states them."""
    kernel = tree("kernels/ragged_paged_attention/v3/kernel.py")
    fn = find(kernel, ast.FunctionDef, "get_kv_cache_shape", "RPA v3 kernel")
    returned = [ast.unparse(n.value) for n in ast.walk(fn) if isinstance(n, ast.Return)]
    assert returned == [
        "(total_num_pages, page_size, align_to(actual_num_kv_heads * 2, kv_packing) // "
        "kv_packing, kv_packing, align_to(actual_head_dim, 128))"
    ]
    create = find(tree("runner/kv_cache.py"), ast.FunctionDef, "create_kv_caches", "kv_cache")
    specs = {ast.unparse(n) for n in ast.walk(create) if isinstance(n, ast.Call)}
    assert (
        "PartitionSpec(ShardingAxisName.BATCH, ShardingAxisName.KV_CONTEXT, "
        "ShardingAxisName.KV_HEAD)" in specs
    )
    assert (
        'REQUIRED_KV_CACHE_LAYOUT = "NHD"'
        in (package_dir() / "offload/tpu_offload_connector.py").read_text()
    )


def test_the_variables_they_read():
    envs = (package_dir() / "envs.py").read_text()
    for name in (
        "TPU_NAME",
        "TPU_WORKER_ID",
        "TPU_ACCELERATOR_TYPE",
        "TPU_OFFLOAD_NUM_CPU_CHUNKS",
        "TPU_OFFLOAD_NUM_STAGING_BLOCKS",
        "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE",
        "TPU_OFFLOAD_DECODE_SAVE",
        "TPU_OFFLOAD_SAVE_THREADS",
        "TPU_OFFLOAD_BATCHED_SAVE",
        "TPU_OFFLOAD_USE_UNPINNED_HOST",
        "TPU_OFFLOAD_BLOCK_SIZE_BUCKETS",
    ):
        assert f'"{name}":' in envs, f"tpu_inference/envs.py no longer defines {name}"
    assert "TPU_SKIP_MDS_QUERY" not in envs  # 0.32.0 probes unless the three are set


OURS = pathlib.Path(__file__).resolve().parents[2] / "jax_kvoffload/bridge/tpu_inference"


def _our_class(relpath: str, name: str) -> ast.ClassDef:
    module = ast.parse((OURS / relpath).read_text(), filename=relpath)
    return find(module, ast.ClassDef, name, f"(ours) {relpath}")


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_our_connector_has_every_method_of_theirs():
    """What vLLM and their runner may call on their connector, ours defines, with the
    same leading parameters (a method they add fails here until ours has it)."""
    relpath = "offload/tpu_offload_connector.py"
    theirs = _methods(find(tree(relpath), ast.ClassDef, "TPUOffloadConnector", relpath))
    ours = _methods(_our_class("_classes.py", "TPUOffloadConnector"))
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"their TPUOffloadConnector has {missing}; ours does not"
    for name, fn in theirs.items():
        want, got = params(fn), params(ours[name])
        assert got[: len(want)] == want, (name, got, want)


def test_our_manager_implements_the_calls_their_scheduler_makes():
    """`StoreManager` has each of the five calls, with their manager's parameters."""
    manager = find(tree("offload/offload_manager.py"), ast.ClassDef, "LRUCacheManager", "")
    theirs = _methods(manager)
    ours = _methods(_our_class("_manager.py", "StoreManager"))
    for name in MANAGER_CALLS:
        assert name in ours, f"StoreManager lacks {name}"
        assert params(ours[name]) == params(theirs[name]), (name, params(theirs[name]))


def test_our_scheduler_subclass_replaces_only_the_manager():
    """`JaxStoreScheduler` overrides nothing of theirs but `__init__`, which calls
    theirs and then sets `offload_manager`."""
    cls = _our_class("_classes.py", "JaxStoreScheduler")
    assert [ast.unparse(b) for b in cls.bases] == ["theirs.TPUOffloadConnectorScheduler"]
    assert set(_methods(cls)) == {"__init__"}
    assigned = {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute)
    }
    assert "offload_manager" in assigned
