"""One request's life: the Engine, the request and its session, admission, events, timeline and metrics."""
