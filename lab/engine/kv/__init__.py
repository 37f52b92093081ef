"""Paged-KV bookkeeping: the block manager (which block holds which tokens, reference counts, the
prefix cache) and the tiers under the prefix cache (host memory, a file)."""
