"""The run explorer: one request live from the engine or replayed from a trace, and what it knows of it."""
