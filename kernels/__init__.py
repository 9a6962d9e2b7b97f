"""Known-answer compute tests: GEMM, ABFT checksums, memory patterns, collectives (CuPy or NumPy/torch)."""
