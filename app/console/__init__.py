"""Headless output on a terminal or a pipe: plain text, JSON lines, progress lines."""
