"""The fast paths, kept apart from the readable model: the lean one-token step and its C stack
(`eager_step`), CUDA graphs (`cuda_graph`), decode rows attended together in the block pool
(`pooled_rows`, `attention_rows`), the packed and panel weight formats (`linear_kernels`,
`panel_kernels`) and the C kernels they call (`cpu_kernels` builds them), and the threads a step
runs on (`decode_threads`). Each computes what `minengine/reference/model.py` computes; the
tests hold them to it (tests/engine/test_reference.py). `minengine.steps.model_runner` picks among them.
"""
