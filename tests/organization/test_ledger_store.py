"""The ledger store and the replay rule: an epoch planned once is read back identically (restart,
replay); epochs are written once and in order; the ledger keeps hubs from being over-trained."""

from __future__ import annotations

import numpy as np
import pytest
from sdo_cases import graph_of, run_epochs

from pipeline.organization.epoch_visits import plan_epoch_visits
from pipeline.organization.exposure_ledger import ExposureLedger
from pipeline.organization.knn_graph import build_knn_graph
from pipeline.organization.ledger_store import MemoryLedgerStore, epoch_visits_for


def test_a_restarted_producer_replays_and_continues_the_same_epochs():
    g, _ = graph_of(60, k=6)
    kw = {"seed": 3, "coverage_epochs": 2}
    store = MemoryLedgerStore()
    first = [epoch_visits_for(store, "job", g, e, **kw) for e in range(4)]
    # A new producer on the same store: replays of planned epochs, then new ones.
    replay = [epoch_visits_for(store, "job", g, e, **kw) for e in range(4)]
    assert [v.visits for v in replay] == [v.visits for v in first]
    more = [epoch_visits_for(store, "job", g, e, **kw) for e in range(4, 6)]
    straight, _ = run_epochs(g, 6, **kw)
    assert [v.visits for v in first + more] == [v.visits for v in straight]
    assert ExposureLedger.from_dict(store.latest("job")).next_epoch == 6
    with pytest.raises(ValueError, match="before epoch 0; cannot plan 6"):
        epoch_visits_for(MemoryLedgerStore(), "job", g, 6, **kw)  # a fresh ledger is at 0


def test_epochs_are_written_once_and_in_order():
    g, _ = graph_of(20)
    store = MemoryLedgerStore()
    ledger = ExposureLedger.initial(g.digest, g.size)
    v0, l1 = plan_epoch_visits(g, ledger, 0, seed=0, coverage_epochs=2)
    store.save("j", v0.to_dict(), l1.to_dict())
    store.save("j", v0.to_dict(), l1.to_dict())  # the same again: a no-op
    other, _ = plan_epoch_visits(g, ledger, 0, seed=1, coverage_epochs=2)
    assert other.visits != v0.visits
    with pytest.raises(ValueError, match="already planned differently"):
        store.save("j", other.to_dict(), l1.to_dict())
    _, l2 = plan_epoch_visits(g, l1, 1, seed=0, coverage_epochs=2)
    v2, l3 = plan_epoch_visits(g, l2, 2, seed=0, coverage_epochs=2)
    with pytest.raises(ValueError, match="out of order"):
        store.save("j", v2.to_dict(), l3.to_dict())


def test_the_ledger_keeps_a_hub_from_being_over_trained():
    # 199 samples scattered around one point: that point is in (nearly) every neighbor list.
    rng = np.random.default_rng(0)
    center = 10 * rng.normal(size=16)
    x = np.concatenate([center[None], center + rng.normal(size=(199, 16))])
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    g = build_knn_graph(tuple(range(200)), x, 8)
    assert g.in_degree.max() >= 4 * g.k  # there is a hub
    epochs, ledger = run_epochs(g, 20, coverage_epochs=3, repeat_gap=4)
    repeats = sum(len(e.visits) - len({v.sample_id for v in e.visits}) for e in epochs)
    assert repeats > 0  # the walk does revisit (short repeat gap)
    # ... yet after 20 epochs of 1 visit per sample on average, nobody is far ahead.
    s = ledger.summary()
    assert s["max"] <= 20 + 3 and s["min"] >= 20 - 4, s
    assert int(ledger.exposure[np.argmax(g.in_degree)]) <= 20 + 3
