"""How a step runs: the plan `ModelRunner.pick`/`pick_rows` makes for it, the shared step over several
sequences' rows, and building the model for this machine (weights' format, ops bound once)."""
