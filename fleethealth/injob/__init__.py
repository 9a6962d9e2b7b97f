"""The in-job library: runs inside training processes, imports nothing heavier than torch and the wire format."""
