"""What runs inside the trainer: the per-rank batch stream and its helpers."""
