"""Serving the engine over HTTP: an OpenAI-compatible endpoint (docs/agents.md, tools/serve.py)."""
