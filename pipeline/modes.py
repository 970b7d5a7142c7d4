"""The named choices a config makes: a job's mode, the rank failure policy and the over-budget
policy, one shared enum each.

A value is the word the config file, the `ODB_*` environment, Redis, the Lua scripts' arguments
and `status` carry (a `StrEnum` compares equal to its word and prints as it), so code compares
against a member, never against a string of its own. A leaf module (no imports of the project),
so the pure planner and the refill rules use it too. Adding a choice means adding a member here
with its meaning.
"""

from __future__ import annotations

from enum import StrEnum


class JobMode(StrEnum):
    """What a job is: a training job in one of the two DGAP modes, or a refill job."""

    JOIN = "join"  # ranks may end an epoch at different steps; every sample exactly once
    QUOTA = "quota"  # every rank the same number of steps; leftovers carried to the next epoch
    REFILL = "refill"  # requests for inference consumers (docs/refill.md): no ranks, no plan


# A training job's modes: how its ranks end an epoch (DGAP, Guarantee 2); the planner's modes.
DGAP_MODES = (JobMode.JOIN, JobMode.QUOTA)


class RankFailurePolicy(StrEnum):
    """What a training job's live ranks get once a rank has been gone `rank_timeout_seconds`."""

    FAIL = "fail"  # a clear ABORTED error naming the rank
    WAIT = "wait"  # keep waiting for it to come back
    SHRINK = "shrink"  # a reconfiguration onto the live ranks (docs/elastic.md)


class OverBudgetPolicy(StrEnum):
    """A sample (or a refill request) that cannot fit its limit on its own."""

    TRUNCATE = "truncate"  # cut it to fit the limit alone, flagged
    ALONE = "alone"  # emit it by itself, flagged as over budget
    QUARANTINE = "quarantine"  # set it aside with the reason over_budget, never emitted
