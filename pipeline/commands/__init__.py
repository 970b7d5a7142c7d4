"""Subcommands of `odb-pipeline`, one module each, and what several share: `cli_job` (the job a
one-shot command preprocesses with) and `plan_output` (what `plan` prints and writes)."""
