"""Keeping a run: trace files, exports, the timeline CSV and telemetry."""
