"""The liveness fault suite (issue #27): its scenarios, rank processes and contract settings."""
