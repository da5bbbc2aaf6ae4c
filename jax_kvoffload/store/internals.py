"""The store package's parts shared with the rest of this library: semi-public.

The vLLM bridge declares vLLM's `ReqContext` a plain-dict context (its positions read
without a Python frame per key) through the hook here, so that no package of ours
reaches into another's private `_modules`. Stable within a release; not user API.
"""

from jax_kvoffload.store._context import register_plain_context as register_plain_context

__all__ = ["register_plain_context"]
