"""Semi-public parts of the offloader package, for bridges that assemble the host tier
themselves instead of through `KVOffloader` (the tpu-inference connector: its store
sits with tpu-inference's scheduler, its pool with the worker, in one process).

- `TierPath`: cascades (host -> tiers) and promotions (tiers -> host) between a
  `HostStore` + `HostPool` and their secondary tiers, with their counters.
- `prefix_chunks`: the longest loadable prefix of a list of hits.
"""

from jax_kvoffload.offloader._cascade import TierPath as TierPath
from jax_kvoffload.offloader._cascade import prefix_chunks as prefix_chunks

__all__ = ["TierPath", "prefix_chunks"]
