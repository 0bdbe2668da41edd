"""Building blocks shared by the architectures, one idea per module: norm, rotary, packed
linear, gated MLP, vocabulary embedding, checkpoint-name weight loading."""
