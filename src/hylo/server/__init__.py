"""OpenAI-compatible server."""
