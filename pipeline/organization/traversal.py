"""The neighborhood traversal: one epoch's visits as a locality-ordered walk on the KNN graph.

A depth-first walk: emit a node, push its neighbors (most similar on top), pop the next one it
may visit. Consecutive visits are neighbors, so a run of visits (what one batch is cut from)
stays inside one region of the graph; when the frontier runs dry the walk jumps to the next
start of `jump_order`. Whether a popped node may be visited:

- a *mandatory* node not yet visited this epoch (coverage floor): always;
- once only mandatory visits fit the budget that is left (`forced`): nothing else;
- a node visited within the last `repeat_gap` visits: never (the caller passes the planner's
  window, so two visits of a sample are not in the window together and so not in one batch);
- a node still *owed* visits (`owed[i] - visits so far > 0`, see `epoch_visits`): always;
- otherwise with probability exp(-STRENGTH * (1 - owed_now)) * min(1, k / in_degree): the
  exposure ledger's discount, and a hub's discount for being reachable from many lists.

Jumps take the first node of `jump_order` not yet visited this epoch (a second pass allows one
more visit, and so on; the repeat gap holds there too unless no node satisfies it), ignoring
the discounts, so the walk always ends with `budget` visits and, because mandatory nodes come
first there, every mandatory node among them. A gap of the graph's size or more means no repeats
within an epoch of at most that many visits. Deterministic in its inputs and `rng`; pure.
"""

from __future__ import annotations

import math
import random

import numpy as np

from pipeline.organization.knn_graph import KnnGraph

STRENGTH = 3.0  # how hard the ledger pushes back on a node past its share (per visit)


def neighborhood_walk(graph: KnnGraph, *, budget: int, mandatory: np.ndarray,
                      owed: np.ndarray, jump_order: np.ndarray, repeat_gap: int,
                      rng: random.Random) -> list[int]:
    """`budget` node indices in visit order.

    `mandatory`: bool [n], nodes that must be visited at least once; `owed`: float [n], visits
    each node is owed this epoch before it counts as over-exposed; `jump_order`: every node once,
    mandatory nodes first (in the order they are due).
    """
    n = graph.size
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if n == 0:
        if budget:
            raise ValueError("cannot plan visits on an empty graph")
        return []
    must = mandatory.tolist()
    owed_l = owed.tolist()
    nbrs = [[v for v in row if v >= 0][::-1] for row in graph.neighbors.tolist()]
    k = max(1, graph.k)
    hub = [min(1.0, k / d) if d else 1.0 for d in graph.in_degree.tolist()]
    jumps = jump_order.tolist()
    if sorted(jumps) != list(range(n)):
        raise ValueError("jump_order must hold every node once")
    recent = max(1, repeat_gap)

    count = [0] * n
    last = [-recent - 1] * n
    left_mandatory = sum(must)
    if left_mandatory > budget:
        raise ValueError(f"{left_mandatory} mandatory visits do not fit a budget of {budget}")
    order: list[int] = []
    stack: list[int] = []
    jp = 0  # next position in jump_order
    jpass = 0  # jump pass: nodes with at most this many visits are jump targets

    def may_visit(v: int, forced: bool) -> bool:
        if must[v] and not count[v]:
            return True
        if forced or len(order) - last[v] <= recent:
            return False
        owed_now = owed_l[v] - count[v]
        if owed_now > 0:
            return True
        return rng.random() < math.exp(-STRENGTH * (1.0 - owed_now)) * hub[v]

    while len(order) < budget:
        forced = budget - len(order) <= left_mandatory
        v = -1
        while stack:
            u = stack.pop()
            if may_visit(u, forced):
                v = u
                break
        if v < 0:  # frontier dry: jump
            scanned = 0
            while True:
                if jp == n:
                    jp, jpass = 0, jpass + 1
                u = jumps[jp]
                jp += 1
                scanned += 1
                if (must[u] and not count[u]) or (
                        not forced and count[u] <= jpass
                        and (not count[u] or len(order) - last[u] > recent or scanned > 2 * n)):
                    v = u
                    break
        if must[v] and not count[v]:
            left_mandatory -= 1
        count[v] += 1
        last[v] = len(order)
        order.append(v)
        stack.extend(nbrs[v])
    return order
