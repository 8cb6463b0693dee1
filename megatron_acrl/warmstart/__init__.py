"""What a run starts from: the tiny local model built on this machine, and the supervised warm start."""
