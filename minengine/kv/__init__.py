"""The KV cache: block-accounted storage per layer, and the arithmetic of its size."""
