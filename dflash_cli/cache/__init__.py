"""The on-disk artifact cache: content-addressed store, locks, integrity checks, upkeep, hashing."""
