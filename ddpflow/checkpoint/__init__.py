"""Checkpoints: the stored format, the latest pointer, and positions inside an epoch."""
