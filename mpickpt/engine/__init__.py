"""The checkpoint engine: staging buffers, background writer processes, the CheckpointManager."""
