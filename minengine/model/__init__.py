"""The transformer (its layer maths once), RoPE, loading, and the runner that picks each step's path."""
