"""A committed checkpoint as a whole, whatever its kind: one rank's part loaded for restore, and
what the `mpickpt` CLI does with one (verify, describe, export). Built on `store` (the format) and
`kinds` (how each kind layers its files)."""
