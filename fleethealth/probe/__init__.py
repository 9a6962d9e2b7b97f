"""The node probe: the supervisor on each GPU node (telemetry sources, step aggregation, spool, metrics)."""
