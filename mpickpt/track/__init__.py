"""Row tracking: which embedding rows changed since the last checkpoint (Check-N-Run §4.1)."""
