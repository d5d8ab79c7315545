"""Memory and latency arithmetic for any model: the planner and its architecture cards."""
