"""The demo with a Mooncake Store tier: `--tier mooncake://MASTER:PORT` becomes a
`secondary_tiers` entry, is checked before the demo starts, and a fresh process serves
the first one's prefix from a private Mooncake Store with logits equal to a full
recompute."""

from __future__ import annotations

import json
import socket

import pytest

from jax_kvoffload.cli import main
from jax_kvoffload.config import MooncakeTierConfig
from jax_kvoffload.demo import DemoConfigError, tier_entry
from jax_kvoffload.demo._config import check_tiers
from tests.demo.test_demo import SMALL_FLAGS

from ._helpers import free_port
from ._mooncake import NO_MOONCAKE, MooncakeStore


def test_a_mooncake_address_becomes_a_tier_entry():
    assert tier_entry("mooncake://10.0.0.5:50051") == {
        "type": "mooncake",
        "master_server_address": "10.0.0.5:50051",
        "metadata_server": "http://10.0.0.5:8080/metadata",
        "local_hostname": "127.0.0.1",
    }
    got = tier_entry("mooncake://h:1?metadata=etcd://e:2379&local=10.0.0.7")
    assert (got["metadata_server"], got["local_hostname"]) == ("etcd://e:2379", "10.0.0.7")
    with pytest.raises(DemoConfigError, match="mooncake://HOST:PORT"):
        tier_entry("mooncake:/h")


def test_an_ipv6_master_gets_a_metadata_url_the_tier_takes():
    entry = tier_entry("mooncake://[::1]:50051")  # was http://::1:8080/metadata: refused
    assert entry["metadata_server"] == "http://[::1]:8080/metadata"
    MooncakeTierConfig(**{k: v for k, v in entry.items() if k != "type"})


@pytest.mark.parametrize(
    "spec",
    [
        "mooncake://h:50051?metdata=http://m:8080/metadata",  # a typo: was dropped silently
        "mooncake://h:50051?local=",  # empty: was the default
        "mooncake://h:50051?local=10.0.0.1&local=10.0.0.2",
        "mooncake://h:50051?junk",
        "mooncake://h:50051/path",
        "mooncake://h:50051#frag",
        "mooncake://user@h:50051",  # was passed on as master "user@h:50051"
    ],
)
def test_an_odd_mooncake_url_is_refused_naming_the_form(spec):
    with pytest.raises(DemoConfigError, match=r"mooncake://HOST:PORT\[\?metadata=URL"):
        tier_entry(spec)


def test_a_master_that_does_not_answer_is_refused_before_the_demo_starts():
    port = free_port()
    with pytest.raises(
        DemoConfigError, match=f"cannot connect to 127.0.0.1:{port}.*mooncake_master"
    ):
        check_tiers([f"mooncake://127.0.0.1:{port}"])


def test_a_metadata_server_that_does_not_answer_is_refused_before_the_demo_starts():
    # The master answers but its metadata server does not: the demo built its model,
    # then Mooncake's setup retried 20 times and the demo failed (exit 1 in two
    # processes, with a FAIL row) instead of refusing the --tier at once.
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen()
        port, meta = master.getsockname()[1], free_port()
        with pytest.raises(
            DemoConfigError,
            match=f"cannot connect to 127.0.0.1:{meta}.*enable_http_metadata_server",
        ):
            check_tiers([f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{meta}/m"])
        check_tiers([f"mooncake://127.0.0.1:{port}?metadata=P2PHANDSHAKE"])  # no server


@pytest.mark.slow  # two engine processes: ~20-30 s on a busy 2-core machine
@pytest.mark.skipif(NO_MOONCAKE is not None, reason=str(NO_MOONCAKE))
def test_two_processes_serve_the_prefix_from_a_mooncake_store(capsys):
    store = MooncakeStore()
    try:
        spec = f"mooncake://{store.master_address}?metadata={store.metadata_server}"
        code = main(["demo", "--two-process", "--json", "--quiet", "--tier", spec, *SMALL_FLAGS])
        out = json.loads(capsys.readouterr().out)
        assert code == 0, out
        (run,) = out["runs"]
        w, r = run["writer"], run["reader"]
        assert w["passed"] and w["tiers"][0]["cascaded"] == 2
        assert r["prefix_hit_blocks"] == 4 and r["tiers"][0]["promoted"] == 2
        assert r["logits_equal"] and r["decode_equal"] and r["max_abs_diff"] == 0.0
    finally:
        store.stop()
