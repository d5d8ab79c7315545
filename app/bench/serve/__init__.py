"""`reqscope bench serve`: load on any OpenAI-compatible server, measured from the client, as `vllm bench serve` does.

`prompts` makes the requests (vLLM's random dataset: random token ids of set lengths),
`arrivals` spaces them (all at once, or Poisson at a request rate), `stream` sends one and times
each streamed chunk on arrival, `load` drives them all, `summary` adds them up into vLLM's
summary block and JSON, and `cli` holds the flags. `response_format` is the structured output a
run may ask for, and `answers` checks every answer against it once the run is over. Nothing here
imports torch: it is an HTTP client, and it must not load what it measures.
"""
