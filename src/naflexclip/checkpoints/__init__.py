"""Checkpoint storage: a save's directory of named states, the `latest` pointer, atomic publishing (`storage`)."""
