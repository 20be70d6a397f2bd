"""RL maths: losses, advantages, mismatch diagnostics, batch filters, non-finite guards, tasks and rewards."""
