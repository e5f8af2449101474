"""The node service: ``tierkv serve`` shares one store among many processes (docs/serve.md)."""
