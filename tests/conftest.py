"""Suite-wide setup.

The interrupt tests send themselves a real SIGINT and expect Python's KeyboardInterrupt.
A shell without job control starts background commands (`cmd &`, `nohup cmd &`, some CI
runners) with SIGINT ignored, and Python then keeps it ignored: those tests would test
how pytest was launched instead of the library. Give the suite Python's own handler.
"""

import signal

import pytest

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-primary Redis Cluster on loopback, shared by the whole session (tests
    that kill, pause or reshard nodes start their own: tests/tiers/_cluster.py)."""
    from tests.tiers._cluster import HAVE_CLUSTER, NO_CLUSTER, RedisCluster

    if not HAVE_CLUSTER:
        pytest.skip(NO_CLUSTER)
    cluster = RedisCluster(3)
    yield cluster
    cluster.stop()


# -- the fast suite -----------------------------------------------------------------------
# Tests marked `slow` (soaks, long interpreter runs, whole-process demos, vLLM's own
# suite) are left out of a plain `pytest` run, which is the README's command; `--slow`
# (or any `-m` expression, e.g. `-m slow` alone, as .ci/run does after the fast run)
# brings them back, and a test named by its node id (`path::name`) always runs.


SLOW_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (soaks, long runs; .ci/run runs them)",
    )


def _named(item, args) -> bool:
    return any("::" in a and item.nodeid.startswith(a.split("[")[0]) for a in args)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or config.option.markexpr:
        return
    args = [str(a) for a in config.args]
    slow = [i for i in items if i.get_closest_marker("slow") and not _named(i, args)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        kept = set(map(id, slow))
        items[:] = [i for i in items if id(i) not in kept]
        config.stash[SLOW_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter, config):
    left = config.stash.get(SLOW_LEFT_OUT, 0)
    if left:
        terminalreporter.write_line(
            f"{left} tests marked slow were left out: run them with --slow "
            "(or -m slow for those alone); .ci/run does"
        )
