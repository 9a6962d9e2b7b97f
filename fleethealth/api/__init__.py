"""HTTP API (FastAPI): recommendations, nodes, runs, quarantine, analyst SQL."""
