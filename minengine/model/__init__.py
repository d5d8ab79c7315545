"""The transformer: its layer maths once, RoPE, and the decode runners (eager scratch-buffer step, CUDA graph)."""
