"""From logits to a token: sampling parameters, the filter chain, the sampler and its step traces."""
