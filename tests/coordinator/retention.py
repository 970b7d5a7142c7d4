"""The trimming rule of the ACK script, as the tests state it: which steps Redis may drop."""

from __future__ import annotations


def expected_trimmed(first_steps: dict[int, int], min_acked: int) -> int:
    """Steps <= the result are trimmed, given each epoch's first step (epochs with published
    steps only) and the slowest rank's cursor: the epoch E of the slowest rank's next step is
    kept, and the last epoch with steps before E (the one the slowest rank finished last, even
    if epochs without steps lie between)."""
    need = min_acked + 1
    started = sorted(e for e, f in first_steps.items() if f <= need)
    before = started[:-1]
    return first_steps[before[-1]] - 1 if before else -1
