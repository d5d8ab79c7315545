"""What the run explorer computes from a run for its panels: latency, KV growth, the layouts compared, device memory."""
