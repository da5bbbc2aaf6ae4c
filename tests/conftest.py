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
