"""jax_kvoffload.transfer (see docs/architecture.md)."""
