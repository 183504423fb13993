"""Recovery: what happens when ranks lose their state. One module per policy; `chain` tries them
in order and `build` wires them for the trainer."""
