"""IncrCP's 2-D chunk store for consecutive incremental checkpoints (Li et al., PVLDB 2024, §4)."""
