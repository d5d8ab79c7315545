"""Text in and out: the chat template, tokenizer, incremental detokenizer, stop strings and prompt parts."""
