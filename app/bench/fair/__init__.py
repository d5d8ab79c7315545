"""The fair comparison: each engine in its own process, as its users run it, timed through pipes.

`compare` runs the rounds, `pipes` launches a child and stamps its token lines on arrival,
`peers` finds the optional other engines (llama.cpp), and `hf_child`, `llama_child` and `probe`
are what the children run. This package imports nothing at import time: the children start with
`python -m reqscope.bench.fair.<child>` and must load torch only after reading their environment.
"""
