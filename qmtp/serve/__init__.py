"""Serving: the continuous-batching engine, its device side, and the OpenAI-compatible HTTP server."""
