"""Streaming detectors (pure ``update(batch) -> findings``) and the runner that feeds them."""
