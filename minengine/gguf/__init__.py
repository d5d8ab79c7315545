"""Reading GGUF files (metadata, hyperparameters, tensors, tokenizer) and converting them into model folders."""
