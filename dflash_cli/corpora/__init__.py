"""Real text corpora present on every machine (the standard library's sources)."""
