"""`reqscope serve`: an OpenAI-compatible HTTP server over one Engine."""
