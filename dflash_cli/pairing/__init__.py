"""A target and its DFlash draft as one pair: resolving, validating, reading speculators drafts."""
