"""Export-ready target and draft modules (static KV cache, context-feature taps)."""
