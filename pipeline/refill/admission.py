"""Admission under a consumer's free token capacity: longest-waiting first, within the budget.

The rule, which the Redis script (`coordinator/lua/refill_refill.lua`) implements too:
walk the waiting requests by arrival order (lowest `seq` first: a re-admitted request keeps
its original seq, so it goes before everything that arrived after it); admit each one whose cost
fits the capacity still free, skip one that does not (a smaller one behind it may fit: the
accelerator stays full), stop when nothing is free or `scan` requests were looked at. A request
flagged over budget (policy `alone`) is admitted only as the one request of a consumer with
nothing in flight that has admitted nothing else in this call; it is the one case where the
admitted cost may exceed the offer, and the reply flags it.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.refill.request import RefillRequest

DEFAULT_SCAN = 512  # requests looked at per call: bounds the work of one admission


def admit(waiting: Iterable[RefillRequest], free_tokens: int, *, consumer_idle: bool = False,
          scan: int = DEFAULT_SCAN) -> list[RefillRequest]:
    """The requests to admit, in arrival order; `waiting` in any order. The total cost of the
    unflagged ones is <= free_tokens; a flagged one is only ever admitted alone."""
    if free_tokens < 0:
        raise ValueError(f"free_tokens must be >= 0, got {free_tokens}")
    free = free_tokens
    out: list[RefillRequest] = []
    for n, req in enumerate(sorted(waiting, key=lambda r: r.seq)):
        if free <= 0 or n >= scan:
            break
        if req.over_budget:
            if consumer_idle and not out:
                return [req]
            continue
        if req.cost <= free:
            out.append(req)
            free -= req.cost
    return out
