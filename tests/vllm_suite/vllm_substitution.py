"""pytest plugin: vLLM 0.33.0's own offloading tests, run against our implementations.

Loaded with ``-p vllm_substitution`` by ``test_vllm_suite.py`` (in a subprocess whose
working directory is the extracted vLLM tests, so that ``tests`` is vLLM's package).
vLLM's test files are never edited: while pytest collects them (imports them), the
names they import are rebound to ours in the modules that define them, so the test
files' globals hold ours; before the first test runs the defining modules get vLLM's
classes back, so that nothing else, above all our own code (our spec takes vLLM's
CPU-spec metric definitions from vLLM's ``CPUOffloadingSpec``), is redirected. The
plugin then checks that no module outside vLLM's tests kept a substitute under a vLLM
name (``vllm_suite_soundness.py``) and refuses to run otherwise.

==========================================================  =============================
vLLM name (module that defines it)                          ours
==========================================================  =============================
``CPUOffloadingManager`` (``vllm.v1.kv_offload.cpu.manager``) ``JaxOffloadingManager`` over
                                                            ``HostStore``, built from
                                                            vLLM's constructor arguments
``LRUCachePolicy``, ``ARCCachePolicy`` (and the "lru"/"arc"   ``LRUPolicy``, ``ARCPolicy``
entries of vLLM's ``CachePolicyFactory``)
``CPUOffloadingSpec`` (``vllm.v1.kv_offload.cpu.spec``, and   ``JaxOffloadingSpec``
the "CPUOffloadingSpec" entry of ``OffloadingSpecFactory``)
``build_offloading_config`` (``...offloading.config``, and    ``offloading_config_from_vllm``,
the name the ``OffloadingConnector`` calls)                  returned as vLLM's dataclass
==========================================================  =============================

The factory entries and the connector's name are swapped for the whole session: tests
and vLLM's own code resolve them by string at run time, and none of our code does (our
store answers "lru"/"arc" itself). vLLM's modules that subclass or import the swapped
names (tiering's spec and manager) are imported first, so they keep vLLM's classes.
The "lru"/"arc" factory entries do reach vLLM's tiering manager, which then hosts our
policies (they implement vLLM's ``CachePolicy`` interface). A test that loads a class
by module path at run time (``spec_module_path="vllm.v1.kv_offload.cpu.spec"``) gets
vLLM's: the manifest lists it (kind "harness").

Where a test reads a vLLM-private attribute that has a public equivalent of ours, the
substitute manager exposes that equivalent read-only under vLLM's name
(``_policy`` -> ``store.policy``, ``_num_evictable_cache_chunks`` ->
``store.num_evictable_chunks``); nothing else is aliased.

Environment stand-ins (vLLM's CI runs these tests on a CUDA machine with a model hub):
the fixtures of vLLM's top-level ``tests/conftest.py`` that these files use (that
conftest imports the whole serving stack and is not extracted); a local
``facebook/opt-125m`` ``config.json`` in an offline Hugging Face cache (the scheduler
tests build a real ``ModelConfig``); ``current_platform.support_hybrid_kv_cache()``
answers True as on CUDA (the scheduler tests enable the hybrid KV cache manager).

``expected_differences.toml`` (beside this file) lists the tests that are expected to
fail against ours, with the reason; each becomes a strict xfail (an unexpected pass
fails the run) whose failure text must match the listed pattern, or a skip.

Options: ``--vllm-reference`` runs vLLM's own classes (no substitution, no xfails; the
skips still apply), to check that a listed test passes on vLLM itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
from typing import Any

import pytest
import vllm_suite_manifest
import vllm_suite_soundness

# facebook/opt-125m's config.json (the model vLLM's connector tests name; no weights
# are read). Kept here so that no download is needed.
_OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


def _offline_model_hub() -> tuple[pathlib.Path, bool]:
    """An offline Hugging Face cache holding only opt-125m's config, and whether this
    process owns it (test_vllm_suite.py passes a folder it removes itself, so that a
    killed run leaves nothing behind)."""
    given = os.environ.get("JAX_KVOFFLOAD_VLLM_SUITE_HF_HOME")
    home = pathlib.Path(given or tempfile.mkdtemp(prefix="jax-kvoffload-vllm-hf-"))
    repo = home / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps(_OPT_125M_CONFIG))
    os.environ["HF_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    return home, not given


# Before vLLM's conftests (loaded ahead of pytest_configure) import huggingface_hub.
_HF_HOME, _OWN_HF_HOME = _offline_model_hub()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--vllm-reference",
        action="store_true",
        help="run vLLM's own classes (no substitution, no expected-difference xfails)",
    )
    parser.addoption(
        "--vllm-suite-report",
        default=None,
        help="write each test's outcome and failure text to this JSON file",
    )


# --- stand-ins for the fixtures of vLLM's top-level tests/conftest.py -------------------


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch):
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate, caplog):
    with caplog.at_level(logging.INFO):
        yield caplog


@pytest.fixture()
def default_vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


# --- substitution ----------------------------------------------------------------------


def _to_vllm_offloading_config(ours: Any) -> Any:
    """Our `OffloadingConfig` as vLLM's dataclass, field by field, values untouched
    (our `extra_config` stays the mapping we return)."""
    from vllm.v1.kv_offload import config as vc

    def shallow(obj: Any) -> dict[str, Any]:
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}

    top = shallow(ours)
    top["groups"] = tuple(vc.OffloadingGroupConfig(**shallow(g)) for g in ours.groups)
    top["model"] = vc.OffloadingModelConfig(**shallow(ours.model))
    top["cache"] = vc.OffloadingCacheConfig(**shallow(ours.cache))
    top["parallel"] = vc.OffloadingParallelConfig(**shallow(ours.parallel))
    names = {f.name for f in dataclasses.fields(vc.OffloadingConfig)}
    return vc.OffloadingConfig(**{k: v for k, v in top.items() if k in names})


def build_offloading_config(vllm_config: Any, kv_cache_config: Any) -> Any:
    """vLLM's `build_offloading_config` signature over our config adapter."""
    from jax_kvoffload.bridge.vllm import offloading_config_from_vllm

    return _to_vllm_offloading_config(offloading_config_from_vllm(vllm_config, kv_cache_config))


def _manager_substitute() -> type:
    from jax_kvoffload.bridge.vllm import JaxOffloadingManager
    from jax_kvoffload.store import HostStore

    class CPUOffloadingManager(JaxOffloadingManager):
        """Our manager behind vLLM's `CPUOffloadingManager` constructor."""

        def __init__(
            self,
            num_chunks: int,
            cache_policy: str = "lru",
            cache_policy_module_path: str | None = None,
            enable_events: bool = False,
            store_threshold: int = 1,
            max_tracker_size: int = 64_000,
            info: Any = None,
        ) -> None:
            store = HostStore(
                num_chunks,
                eviction_policy=cache_policy,
                cache_policy_module_path=cache_policy_module_path,
                enable_events=enable_events,
                store_threshold=store_threshold,
                max_tracker_size=max_tracker_size,
            )
            super().__init__(store, None if info is None else info.as_config_info())

        # vLLM-private names with a public equivalent of ours (read-only).
        @property
        def _policy(self) -> Any:
            return self.store.policy

        @property
        def _num_evictable_cache_chunks(self) -> int:
            return self.store.num_evictable_chunks

    CPUOffloadingManager.__qualname__ = "substitute.CPUOffloadingManager"
    return CPUOffloadingManager


class Substitution:
    """What the plugin swaps, in two scopes.

    ``names``: (module, attribute, ours) rebound in vLLM's modules only while pytest
    collects, i.e. while vLLM's test files (and their helpers) run their imports, so
    the test files' own globals hold ours; undone before any test runs, so that every
    other reference, above all our own code's lazy imports of vLLM's classes (our spec
    takes its metric definitions from vLLM's ``CPUOffloadingSpec``), reaches vLLM's
    real classes. ``registry``: (factory registry, name, loader) swapped for the whole
    session, because tests and vLLM's own code (the connector, the tiering manager)
    resolve these names by string at run time. Our code resolves none of them: our
    store answers "lru" and "arc" itself and asks vLLM's ``CachePolicyFactory`` only
    for other names; nothing of ours asks ``OffloadingSpecFactory``.
    """

    def __init__(self) -> None:
        # vLLM modules that subclass or bind the substituted names keep vLLM's
        # classes: import them before anything is rebound.
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.config as config_mod
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as connector
        import vllm.v1.kv_offload.cpu.manager as manager_mod
        import vllm.v1.kv_offload.cpu.policies.arc as arc_mod
        import vllm.v1.kv_offload.cpu.policies.lru as lru_mod
        import vllm.v1.kv_offload.cpu.spec as spec_mod
        import vllm.v1.kv_offload.tiering.manager
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        from jax_kvoffload.bridge._vllm_spec import build_spec_classes
        from jax_kvoffload.store import ARCPolicy, LRUPolicy

        spec_cls = build_spec_classes()["JaxOffloadingSpec"]
        manager_cls = _manager_substitute()
        self.names = [
            (manager_mod, "CPUOffloadingManager", manager_cls),
            (lru_mod, "LRUCachePolicy", LRUPolicy),
            (arc_mod, "ARCCachePolicy", ARCPolicy),
            (spec_mod, "CPUOffloadingSpec", spec_cls),
            (config_mod, "build_offloading_config", build_offloading_config),
        ]
        self.registry = [
            (CachePolicyFactory._registry, "lru", lambda: LRUPolicy),
            (CachePolicyFactory._registry, "arc", lambda: ARCPolicy),
            (OffloadingSpecFactory._registry, "CPUOffloadingSpec", lambda: spec_cls),
        ]
        # The connector is vLLM's code under test; the name it calls is swapped for
        # the session (nothing of ours calls vLLM's connector).
        self.connector = (connector, "build_offloading_config", build_offloading_config)

    def apply_registry(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for registry, name, loader in self.registry:
            monkeypatch.setitem(registry, name, loader)
        monkeypatch.setattr(*self.connector)

    def apply_names(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for module, name, ours in self.names:
            monkeypatch.setattr(module, name, ours)

    def unsound_bindings(self, modules: dict[str, Any]) -> list[str]:
        """``module.attribute`` for each reference to ours, outside vLLM's test
        package, under a name that should reach vLLM's class
        (`vllm_suite_soundness.unsound_bindings`)."""
        return vllm_suite_soundness.unsound_bindings(
            modules,
            {name: ours for _, name, ours in self.names},
            allowed=(f"{self.connector[0].__name__}.{self.connector[1]}",),
        )


def _platform_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    # vLLM's CI runs the connector tests on CUDA, where the hybrid KV cache manager
    # is supported; the tests enable it explicitly.
    monkeypatch.setattr(current_platform, "support_hybrid_kv_cache", lambda: True)


class _Plugin:
    def __init__(self, config: pytest.Config) -> None:
        self.reference = config.getoption("--vllm-reference")
        self.report_path = config.getoption("--vllm-suite-report")
        self.entries = vllm_suite_manifest.load().entries
        self.results: dict[str, dict[str, str]] = {}
        self.monkeypatch = pytest.MonkeyPatch()
        _platform_stand_ins(self.monkeypatch)
        self.substitution = None if self.reference else Substitution()
        if self.substitution is not None:
            self.substitution.apply_registry(self.monkeypatch)

    def close(self) -> None:
        self.monkeypatch.undo()

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session):
        # vLLM's test files import the swapped names while they are collected: only
        # then do vLLM's modules hold ours (see `Substitution`).
        if self.substitution is None:
            return (yield)
        names = pytest.MonkeyPatch()
        self.substitution.apply_names(names)
        try:
            result = yield
        finally:
            names.undo()
        unsound = self.substitution.unsound_bindings(dict(sys.modules))
        if unsound:
            raise pytest.UsageError(
                "the substitution leaked beyond vLLM's test files: these references "
                f"should reach vLLM's classes but hold ours: {unsound} (import the "
                "module before the names are swapped, in Substitution.__init__)"
            )
        return result

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        for item in items:
            entry = next((e for e in self.entries if e.matches(item.nodeid)), None)
            if entry is None:
                continue
            reason = entry.marker_reason
            if entry.kind == "environment":
                item.add_marker(pytest.mark.skip(reason=reason))
            elif not self.reference:
                item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
                item.stash[_MATCH] = entry.match

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # A stale entry (a renamed test, a wrong id) must not linger unnoticed. Checked
        # for the files run whole, unless -k narrows the run.
        if session.config.option.keyword:
            return
        whole = {str(a) for a in session.config.args if "::" not in str(a)}
        stale = [
            t
            for e in self.entries
            for t, hits in e.hits.items()
            if hits == 0 and t.split("::")[0] in whole
        ]
        if stale:
            raise pytest.UsageError(
                f"{vllm_suite_manifest.MANIFEST.name}: entries match no collected test: {stale}"
            )

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        pattern = item.stash.get(_MATCH, None)
        if pattern and getattr(report, "wasxfail", None) is not None and call.excinfo:
            text = call.excinfo.exconly()
            if not re.search(pattern, text):
                report.outcome = "failed"
                report.longrepr = (
                    f"[listed as an expected difference, but failed differently] "
                    f"expected /{pattern}/ in the failure, got:\n"
                    f"{item.repr_failure(call.excinfo)}"
                )
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # One line per test: the first failing phase wins, else the call's outcome.
        if report.nodeid in self.results and self.results[report.nodeid]["outcome"] in (
            "failed",
            "error",
        ):
            return
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif hasattr(report, "wasxfail"):
            outcome = "xfailed"
        elif report.skipped:
            outcome = "skipped"
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        text = ""
        if report.failed:
            text = report.longreprtext[-4000:]
        elif outcome in ("skipped", "xfailed"):
            text = getattr(report, "wasxfail", "") or str(report.longrepr[-1])
        self.results[report.nodeid] = {"outcome": outcome, "when": report.when, "text": text}

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.report_path:
            pathlib.Path(self.report_path).write_text(json.dumps(self.results, indent=0))


_MATCH = pytest.StashKey[str | None]()
_PLUGIN = pytest.StashKey[_Plugin]()


def pytest_configure(config: pytest.Config) -> None:
    plugin = _Plugin(config)
    config.stash[_PLUGIN] = plugin
    config.pluginmanager.register(plugin, "vllm_substitution_session")


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.stash.get(_PLUGIN, None)
    if plugin is not None:
        plugin.close()
    if _OWN_HF_HOME:
        shutil.rmtree(_HF_HOME, ignore_errors=True)
