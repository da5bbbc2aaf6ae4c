"""A kernel backend added at run time (`register_backend`): chosen by name everywhere,
never by `auto`; names and kernels checked; taken back by `unregister_backend`; and
`_backend_contract.run_backend_contract` (CONTRIBUTING.md's check) sees a broken one."""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.blocks import xla
from pallas_kernels.blocks.backends import (
    Backend,
    pick_backend,
    register_backend,
    unregister_backend,
)

from ._backend_contract import run_backend_contract
from .cases import Case, make_caches


@dataclasses.dataclass(frozen=True, kw_only=True)
class WordsConfig:
    word_bytes: int | None = None


def xla_gather(words, ids, *, config, interpret):
    return xla.gather_words(words, ids)


def xla_scatter(words, ids, staging, *, config, interpret):
    return xla.scatter_words(words, ids, staging)


def record(name: str, scatter=xla_scatter) -> Backend:
    kernels = types.SimpleNamespace(gather_words=xla_gather, scatter_words=scatter)
    return Backend(
        name=name, where="anywhere", how="xla's words", config=WordsConfig, kernels=kernels,
        platforms=None,
    )  # fmt: skip


@pytest.fixture
def registered():
    names = []

    def add(backend: Backend) -> Backend:
        register_backend(backend)
        names.append(backend.name)
        return backend

    yield add
    for name in names:
        unregister_backend(name)
    assert [b.name for b in pk.list_backends()] == list(pk.BACKENDS[1:])


def test_a_registered_backend_is_chosen_by_name_never_by_auto(registered):
    mine = registered(record("words"))
    assert pk.get_backend("words") is mine and pk.list_backends()[-1] is mine
    assert "words" in pk.supported_backends()
    assert pick_backend(jax.devices()[0]).name == "xla"  # auto keeps the built-ins first
    case = Case("nhd", "uint8", 1, 4, 8, 3)
    caches = make_caches(case)
    ids = np.array([5, 0, 66], np.int32)
    got = pk.gather_blocks(caches, ids, layout=pk.KVLayout.nhd(), backend="words")
    want = pk.gather_blocks_reference(caches, ids, layout=pk.KVLayout.nhd())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_registration_checks_the_name_and_the_kernels(registered):
    with pytest.raises(pk.BackendConfigError, match="'xla' is taken"):
        register_backend(record("xla"))
    with pytest.raises(pk.BackendConfigError, match="'auto' is taken"):
        register_backend(record("auto"))
    with pytest.raises(TypeError, match=r"lack \['scatter_words'\]"):
        register_backend(dataclasses.replace(record("half"), kernels=types.SimpleNamespace(
            gather_words=lambda *a, **k: None)))  # fmt: skip
    with pytest.raises(TypeError, match="must be a Backend record"):
        register_backend("words")
    registered(record("twice"))
    with pytest.raises(pk.BackendConfigError, match="'twice' is taken"):
        register_backend(record("twice"))
    for name in ("xla", "never"):
        with pytest.raises(pk.BackendUnavailableError, match=repr(name)):
            unregister_backend(name)


def test_the_contract_passes_a_correct_backend_and_sees_a_wrong_page(registered):
    registered(record("words"))
    run_backend_contract("words")

    def off_by_one(words, ids, staging, *, config, interpret):  # writes the next page
        return xla.scatter_words(words, (ids + 1) % words[0].shape[1], staging)

    registered(record("off-by-one", scatter=off_by_one))
    with pytest.raises(AssertionError):
        run_backend_contract("off-by-one")
