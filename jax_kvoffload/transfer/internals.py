"""The transfer package's parts shared with the rest of this library: semi-public.

`KVOffloader` (jax_kvoffload/offloader/) checks its arguments with the same helpers
the engine uses, and the vLLM bridge's torch worker runs its jobs
on the engine's job core and stages with its helpers; they import them from here so that
no package of ours reaches into another's private `_modules`. Stable within a release;
not user API.
"""

from jax_kvoffload.transfer._caches import check_distinct as check_distinct
from jax_kvoffload.transfer._job_core import EngineJob as EngineJob
from jax_kvoffload.transfer._job_core import JobCore as JobCore
from jax_kvoffload.transfer._job_core import JobError as JobError
from jax_kvoffload.transfer._staging import bucket_for as bucket_for
from jax_kvoffload.transfer._staging import to_host as to_host

__all__ = [
    "EngineJob",
    "JobCore",
    "JobError",
    "bucket_for",
    "check_distinct",
    "to_host",
]
