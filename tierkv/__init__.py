"""tierkv: a tiered KV-cache store for LLM serving engines."""

__version__ = "0.1.0"
