"""Paged attention's model side: the per-forward metadata and the layer that writes the cache and
attends through the backend (the backends themselves are in model/backends/)."""
