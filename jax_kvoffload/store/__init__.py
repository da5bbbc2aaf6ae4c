"""jax_kvoffload.store (see docs/architecture.md)."""
