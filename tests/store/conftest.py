"""Fixtures for the host-store tests."""

from __future__ import annotations

import pytest

from jax_kvoffload.store import RequestContext


@pytest.fixture(params=["lru", "arc"])
def policy_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def ctx() -> RequestContext:
    """The one request context shared by every call, as in vLLM's manager tests."""
    return RequestContext("shared")
