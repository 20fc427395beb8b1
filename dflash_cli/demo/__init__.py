"""Training of the shipped demo pair (tokenizer, target, DFlash draft) on the Python stdlib."""
