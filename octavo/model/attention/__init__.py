"""Paged attention: per-forward metadata, the layer that writes the cache, and the backends
(`reference` in plain torch, `sdpa` through scaled_dot_product_attention)."""
