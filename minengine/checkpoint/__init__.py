"""Model folders on disk: safetensors loading, the in-memory weight layout and its cache, shards, paths."""
