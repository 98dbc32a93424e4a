"""Pure operations on snapshots: perturbations (roll, truncate, scramble), suffix rolls with sinks,
transfers between prompts and models. Each module takes snapshots and returns new ones."""
