"""Shipped fault scenarios (YAML)."""
