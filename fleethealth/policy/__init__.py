"""Decisions: eviction payback with guards, quarantine, paging on patterns, goodput and budget arithmetic."""
