"""Decoding loops: plain greedy/sampled baseline and the DFlash speculative loop."""
