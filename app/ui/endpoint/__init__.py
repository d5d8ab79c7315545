"""The endpoint explorer: one request streamed from a server, its view and its panels."""
