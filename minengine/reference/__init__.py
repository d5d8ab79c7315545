"""The reference engine: the model and its generation loop in plain PyTorch, the oracle every
fast path is tested against (`model.py`, then `generate.py`; `minengine.steps.reference_runner`
runs it inside the engine)."""
