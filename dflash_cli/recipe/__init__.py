"""Recipes: the schema with its defaults and validation, and finding recipe files."""
