"""`reqscope --base-url URL`: one request against any OpenAI-compatible server, timed from the client."""
