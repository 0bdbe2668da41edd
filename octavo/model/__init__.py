"""Model definitions, weights loading and paged attention.

Takes flat token tensors plus attention metadata and returns hidden states and logits; knows
nothing of requests or scheduling and imports nothing from octavo outside this package. Entry
points: `loader.load_model`, `kv_cache.allocate_kv_cache`, `attention.metadata.AttentionMetadata`.
Nothing is imported here, so that `octavo.model.config` stays free of torch.
"""
