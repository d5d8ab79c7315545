"""Inside the step: where a decode step's query looked in the KV cache, and what each layer would have said."""
