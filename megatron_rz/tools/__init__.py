"""Diagnostic commands: `rz check` (parity + localisation) and `rz bench rollout`."""
