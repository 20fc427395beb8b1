"""Hugging Face checkpoints on disk: locating and fingerprinting them, lazy tensor access, text paths."""
