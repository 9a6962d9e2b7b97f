"""Fleet simulator: racks × nodes × GPUs and one synchronous job, with fault injection, in event time."""
