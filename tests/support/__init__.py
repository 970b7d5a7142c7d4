"""Helpers shared by test folders: waiting on conditions, a `serve` process, ..."""
