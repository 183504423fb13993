"""Checkpoint-only quantization of embedding rows (Check-N-Run §4.2): codecs and bit packing."""
