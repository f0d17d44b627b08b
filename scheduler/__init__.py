"""Iteration-level scheduling: requests, blocks, state slots (pure Python, no torch)."""
