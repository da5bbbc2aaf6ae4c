"""The translation's parts: semi-public, for this library's packages, tools and tests.

`build_offloading_config` (in `jax_kvoffload.config`) is the user API. Its steps, the
certification gates `config explain` prints, the JSON description loader, the value
checks, the trusted construction the vLLM adapter uses and the tier registry
(`TierKind`, re-exported for users by `jax_kvoffload.tiers`) live here, so that our other
packages never import `jax_kvoffload.config._*` modules (the error root is defined here
because `config` imports nothing of ours; users import it from `jax_kvoffload.errors`).
Names here are stable within a release; they are not part of the user API.
"""

from jax_kvoffload.config._block_sizes import (
    resolve_dcp_kv_block_size as resolve_dcp_kv_block_size,
)
from jax_kvoffload.config._block_sizes import (
    resolve_kv_cache_block_sizes as resolve_kv_cache_block_sizes,
)
from jax_kvoffload.config._describe import SPEC_TYPES as SPEC_TYPES
from jax_kvoffload.config._describe import engine_config_from_dict as engine_config_from_dict
from jax_kvoffload.config._describe import (
    kv_cache_config_from_dict as kv_cache_config_from_dict,
)
from jax_kvoffload.config._describe import load_description as load_description
from jax_kvoffload.config._describe import spec_from_dict as spec_from_dict
from jax_kvoffload.config._dtypes import as_dtype as as_dtype
from jax_kvoffload.config._dtypes import sub_byte_bits as sub_byte_bits
from jax_kvoffload.config._errors import KVOffloadError as KVOffloadError
from jax_kvoffload.config._errors import KVOffloadStateError as KVOffloadStateError
from jax_kvoffload.config._errors import KVOffloadTypeError as KVOffloadTypeError
from jax_kvoffload.config._errors import KVOffloadValueError as KVOffloadValueError
from jax_kvoffload.config._frozen import FrozenDict as FrozenDict
from jax_kvoffload.config._frozen import freeze as freeze
from jax_kvoffload.config._frozen import thaw as thaw
from jax_kvoffload.config._gates import Check as Check
from jax_kvoffload.config._gates import Verdict as Verdict
from jax_kvoffload.config._gates import spec_certifiable as spec_certifiable
from jax_kvoffload.config._host_tier import HOST_POOLS as HOST_POOLS
from jax_kvoffload.config._medium import Medium as Medium
from jax_kvoffload.config._signature import SignatureError as SignatureError
from jax_kvoffload.config._signature import checked_arguments as checked_arguments
from jax_kvoffload.config._specs import iter_layer_specs as iter_layer_specs
from jax_kvoffload.config._specs import kv_quant_mode_for as kv_quant_mode_for
from jax_kvoffload.config._tier_kinds import TierKind as TierKind
from jax_kvoffload.config._tier_kinds import kind_names_in_words as kind_names_in_words
from jax_kvoffload.config._tier_kinds import register_tier_kind as register_tier_kind
from jax_kvoffload.config._tier_kinds import (
    tier_kind_for_vllm_class as tier_kind_for_vllm_class,
)
from jax_kvoffload.config._tier_kinds import tier_kinds as tier_kinds
from jax_kvoffload.config._tier_kinds import unregister_tier_kind as unregister_tier_kind
from jax_kvoffload.config._tier_options import TierOptions as TierOptions
from jax_kvoffload.config._tiers import (
    secondary_tiers_from_extra_config as secondary_tiers_from_extra_config,
)
from jax_kvoffload.config._tiers import tier_config_from_dict as tier_config_from_dict
from jax_kvoffload.config._translate import Certification as Certification
from jax_kvoffload.config._translate import certify as certify
from jax_kvoffload.config._translate import get_offloading_group_ids as get_offloading_group_ids
from jax_kvoffload.config._translate import (
    get_sliding_window_size_in_chunks as get_sliding_window_size_in_chunks,
)
from jax_kvoffload.config._translate import group_kv_bytes_per_block as group_kv_bytes_per_block
from jax_kvoffload.config._validate import check_int as check_int
from jax_kvoffload.config._validate import from_trusted_fields as from_trusted_fields
from jax_kvoffload.config._validate import show as show

__all__ = [
    "HOST_POOLS",
    "SPEC_TYPES",
    "Certification",
    "Check",
    "FrozenDict",
    "KVOffloadError",
    "KVOffloadStateError",
    "KVOffloadTypeError",
    "KVOffloadValueError",
    "Medium",
    "SignatureError",
    "TierKind",
    "TierOptions",
    "Verdict",
    "as_dtype",
    "certify",
    "check_int",
    "checked_arguments",
    "engine_config_from_dict",
    "freeze",
    "from_trusted_fields",
    "get_offloading_group_ids",
    "get_sliding_window_size_in_chunks",
    "group_kv_bytes_per_block",
    "iter_layer_specs",
    "kind_names_in_words",
    "kv_cache_config_from_dict",
    "kv_quant_mode_for",
    "load_description",
    "register_tier_kind",
    "resolve_dcp_kv_block_size",
    "resolve_kv_cache_block_sizes",
    "secondary_tiers_from_extra_config",
    "show",
    "spec_certifiable",
    "spec_from_dict",
    "sub_byte_bits",
    "thaw",
    "tier_config_from_dict",
    "tier_kind_for_vllm_class",
    "tier_kinds",
    "unregister_tier_kind",
]
