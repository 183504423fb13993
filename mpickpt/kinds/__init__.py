"""Checkpoint kinds: what each save writes, what it builds on, where its files go and how restore
layers it (one module per kind; `registry` lists them)."""
