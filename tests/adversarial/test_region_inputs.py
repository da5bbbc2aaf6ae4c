"""`SharedHostRegion` names that cannot be encoded: a typed argument error, not a raw
UnicodeEncodeError from hashing the socket name."""

from __future__ import annotations

import pytest

from jax_kvoffload.hostmem import SharedHostRegion
from jax_kvoffload.hostmem._shared_region import SharedRegionArgumentError


@pytest.mark.parametrize("name", ["\ud800", "engine-\udcff"])
def test_a_name_with_a_lone_surrogate_is_an_argument_error(name):
    with pytest.raises(SharedRegionArgumentError, match="name"):
        SharedHostRegion(name, 4096, 1, timeout=1)
