"""The HTTP API: one protocol-neutral generation core, thin OpenAI / Anthropic adapters."""
