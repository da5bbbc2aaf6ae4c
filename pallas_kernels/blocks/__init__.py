"""gather_blocks / scatter_blocks: paged KV blocks to and from one contiguous staging array."""
