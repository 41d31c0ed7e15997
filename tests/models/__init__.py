"""Test helpers that build small models (not tests themselves)."""
