"""The OpenAI wire formats: request schema, response bodies and chunks, log probabilities."""
