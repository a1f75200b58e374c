"""``graft serve``: an OpenAI-compatible HTTP server over one Generator (docs/serve.md)."""
