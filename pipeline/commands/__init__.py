"""Subcommands of `odb-pipeline`, one module each."""
