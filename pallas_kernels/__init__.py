"""Pallas kernels that gather paged KV blocks into a staging buffer and scatter them back.

Standalone: nothing here imports jax_kvoffload.
"""
