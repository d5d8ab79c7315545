"""The KV cache: block-accounted storage per layer, what it holds (torch-free), and the arithmetic of its size."""
