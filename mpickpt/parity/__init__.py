"""In-memory parity of embedding shards and their optimizer state (ECRM), kept exact and up to date
inside every training step, with pause-free rebuild of lost ranks. See README "In-memory parity
(ECRM)"."""
