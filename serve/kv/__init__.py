"""The KV cache's memory: the one KV shape and budget (budget.py), the block pool with prefix caching (cache.py),
zeroed buffers taken page by page (memory.py) and where the gqa runner's K/V live, host or GPU (device.py)."""
