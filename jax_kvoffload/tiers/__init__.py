"""Secondary tiers behind the host store: a crash-safe disk tier, a shared tier on a
Redis-protocol server or cluster, and one on a Mooncake Store (docs/tiers.md).

Each implements `SecondaryTier` (the contract is its docstring) and store self-describing
entries (`_entry.py`): a header with the namespace digest of the engine's
`OffloadingConfig`, the key, the length and a CRC32C of the payload. A hit never returns
wrong bytes. `open_tier(config, namespace)` builds a tier from its typed configuration
(`parse_secondary_tiers` reads vLLM's `secondary_tiers` extra-config key).

Each kind of tier is declared once, by a `TierKind` in the tier registry (its `type`,
its configuration class, its `SecondaryTier` class, its vLLM class name); the parser,
`open_tier` and the vLLM classes follow from it. `register_tier_kind` adds a kind at run
time (CONTRIBUTING.md, "Adding a tier").
"""

from jax_kvoffload.config import DiskTierConfig as DiskTierConfig
from jax_kvoffload.config import MooncakeTierConfig as MooncakeTierConfig
from jax_kvoffload.config import RedisTierConfig as RedisTierConfig
from jax_kvoffload.config import TierConfig as TierConfig
from jax_kvoffload.config import TierConfigError as TierConfigError
from jax_kvoffload.config import VllmTierConfig as VllmTierConfig
from jax_kvoffload.config import parse_secondary_tiers as parse_secondary_tiers
from jax_kvoffload.config.internals import TierKind as TierKind
from jax_kvoffload.config.internals import TierOptions as TierOptions
from jax_kvoffload.config.internals import register_tier_kind as register_tier_kind
from jax_kvoffload.config.internals import tier_kinds as tier_kinds
from jax_kvoffload.config.internals import unregister_tier_kind as unregister_tier_kind
from jax_kvoffload.tiers._base import SecondaryTier as SecondaryTier
from jax_kvoffload.tiers._base import TierCounters as TierCounters
from jax_kvoffload.tiers._base import TierJobResult as TierJobResult
from jax_kvoffload.tiers._crc import CRC32C_BACKEND as CRC32C_BACKEND
from jax_kvoffload.tiers._crc import crc32c as crc32c
from jax_kvoffload.tiers._disk import DiskTier as DiskTier
from jax_kvoffload.tiers._entry import ENTRY_VERSION as ENTRY_VERSION
from jax_kvoffload.tiers._entry import namespace_digest as namespace_digest
from jax_kvoffload.tiers._entry import namespace_fields as namespace_fields
from jax_kvoffload.tiers._errors import DirectIOUnavailableError as DirectIOUnavailableError
from jax_kvoffload.tiers._errors import TierBufferSizeError as TierBufferSizeError
from jax_kvoffload.tiers._errors import TierClosedError as TierClosedError
from jax_kvoffload.tiers._errors import TierKeyError as TierKeyError
from jax_kvoffload.tiers._errors import TierStateError as TierStateError
from jax_kvoffload.tiers._errors import UnsafeDirectoryError as UnsafeDirectoryError
from jax_kvoffload.tiers._factory import open_tier as open_tier
from jax_kvoffload.tiers._factory import tier_class as tier_class
from jax_kvoffload.tiers._mooncake import MooncakeTier as MooncakeTier
from jax_kvoffload.tiers._redis import RedisTier as RedisTier
from jax_kvoffload.tiers._redis import RedisTopology as RedisTopology

__all__ = [
    "CRC32C_BACKEND",
    "ENTRY_VERSION",
    "DirectIOUnavailableError",
    "DiskTier",
    "DiskTierConfig",
    "MooncakeTier",
    "MooncakeTierConfig",
    "RedisTier",
    "RedisTierConfig",
    "RedisTopology",
    "SecondaryTier",
    "TierBufferSizeError",
    "TierClosedError",
    "TierConfig",
    "TierConfigError",
    "TierCounters",
    "TierJobResult",
    "TierKeyError",
    "TierKind",
    "TierOptions",
    "TierStateError",
    "UnsafeDirectoryError",
    "VllmTierConfig",
    "crc32c",
    "namespace_digest",
    "namespace_fields",
    "open_tier",
    "parse_secondary_tiers",
    "register_tier_kind",
    "tier_class",
    "tier_kinds",
    "unregister_tier_kind",
]
