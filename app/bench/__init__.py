"""`reqscope bench`: minengine against Hugging Face transformers, measured in turns, with a roofline."""
