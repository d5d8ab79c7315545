"""The server's own view of one endpoint request: what vLLM, llama-server or `reqscope serve` report about it."""
