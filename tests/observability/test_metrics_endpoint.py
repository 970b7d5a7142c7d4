"""`/metrics` on a live service: parses as Prometheus text, moves while ranks consume, and adds
up exactly once everything is consumed."""

from __future__ import annotations

import urllib.request

from obs_helpers import JOB, Rank, samples, served
from prometheus_client.parser import text_string_to_metric_families
from support.waiting import wait_for

from pipeline.observability.metrics import metric_names


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def values(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, for every odb_* sample."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("odb_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(v: dict, name: str, **labels: str) -> float:
    return sum(x for (n, lab), x in v.items()
               if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))


def test_metrics_parse_and_counters_move_while_consuming() -> None:
    with served() as (svc, port):
        ranks = [Rank(svc.address, 0, 2).start(), Rank(svc.address, 1, 2).start()]
        try:
            for r in ranks:
                r.wait_taken()
            wait_for(lambda: all(svc.runtimes[JOB].state.acked(i) == ranks[i].steps[-1]
                                 for i in range(2)), what="acks")
            text = scrape(port)
            first = values(text)
            families = {f.name for f in text_string_to_metric_families(text)}
            assert "process_cpu_seconds" in families  # the process collector is there too
            for i in range(2):
                rl = {"job_id": JOB, "rank": str(i)}
                assert total(first, "odb_rank_acked_step", **rl) == ranks[i].steps[-1]
                assert total(first, "odb_replica_rank_connected", **rl,
                             replica=svc.replica_id) == 1.0
                # Fetched for the batches taken, and for the one prefetched after them.
                assert total(first, "odb_replica_samples_fetched_total", **rl) >= sum(
                    len(b.info.sample_ids) for b in ranks[i].batches)
                assert total(first, "odb_batches_emitted_total", **rl) >= 2
            assert total(first, "odb_step_published", job_id=JOB) >= 1
            assert total(first, "odb_samples_in_total", job_id=JOB) > 0

            ranks[0].more(3)  # rank 0 consumes three more batches
            wait_for(lambda: svc.runtimes[JOB].state.acked(0) == ranks[0].steps[-1],
                     what="rank 0's ack")
            second = values(scrape(port))
            for name in ("odb_samples_emitted_total", "odb_tokens_emitted_total",
                         "odb_batches_emitted_total", "odb_batch_cost_total"):
                assert total(second, name, rank="0") > total(first, name, rank="0"), name
                assert total(second, name, rank="1") == total(first, name, rank="1"), name
            assert total(second, "odb_rank_acked_step", rank="0") == ranks[0].steps[-1]
            assert total(second, "odb_batches_emitted_total", rank="0") == (
                total(first, "odb_batches_emitted_total", rank="0") + 3)
        finally:
            for r in ranks:
                r.release()


def test_metrics_totals_are_exact_after_full_consumption() -> None:
    items = samples(120)
    with served(items) as (svc, port):
        ranks = [Rank(svc.address, 0, None).start(), Rank(svc.address, 1, None).start()]
        try:
            for r in ranks:
                r.wait_taken()
            batches = [b for r in ranks for b in r.batches]
            wait_for(lambda: values(scrape(port)).get(
                ("odb_samples_emitted_total", (("job_id", JOB), ("rank", "1")))) == sum(
                    len(b.info.sample_ids) for b in ranks[1].batches), what="final scrape")
            v = values(scrape(port))
            assert total(v, "odb_samples_emitted_total") == len(items)
            assert total(v, "odb_tokens_emitted_total") == sum(s.num_tokens for s in items)
            assert total(v, "odb_batches_emitted_total") == len(batches)
            # Padding = the zeros of every attention mask the ranks received (padded collate).
            pad = sum(int((b["attention_mask"] == 0).sum()) for b in batches)
            assert total(v, "odb_padded_tokens_total") == pad
            assert total(v, "odb_samples_planned_total") == len(items)
            assert total(v, "odb_job_done") == 1.0
            for i in range(2):
                assert total(v, "odb_rank_lag_steps", rank=str(i)) == 0
        finally:
            for r in ranks:
                r.release()


def test_every_declared_metric_is_exported() -> None:
    with served() as (_svc, port):
        text = scrape(port)
        assert "<table" in scrape(port, "/status") and scrape(port, "/healthz") == "ok\n"
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    exported |= {f.name for f in text_string_to_metric_families(text)}  # empty families too
    missing = {n for n in metric_names() if n not in exported
               and n.removesuffix("_total") not in exported}
    assert not missing, missing


def test_metrics_hold_no_per_record_details() -> None:
    """Record ids, their details and client ids are on the status JSON, never in a metric
    label; every label comes from a bounded set."""
    import json

    from pipeline.preprocess.array_source import synthetic_samples
    from pipeline.preprocess.sample import QuarantinedRecord
    from pipeline.quarantine import QuarantineReason

    bad = QuarantinedRecord("private-notes.jsonl", 3, QuarantineReason.BAD_JSON,
                            "Expecting value near 'password=hunter2'")
    with served([bad, *synthetic_samples(40, seed=3, max_len=128, vocab=100)]) as (svc, port):
        rank = Rank(svc.address, 0, 1).start()
        try:
            rank.wait_taken()
            wait_for(lambda: svc.runtimes[JOB].state.counters().quarantined == 1,
                     what="the bad record")
            job = json.loads(scrape(port, "/status.json?quarantine=1"))["jobs"][0]
            client = job["ranks"][0]["client_id"]
            assert client and job["quarantine"]["records"] == [
                {"sample_id": "private-notes.jsonl:3", "reason": "bad_json",
                 "detail": bad.detail}]
            text = scrape(port)
        finally:
            rank.release()
    for private in (client, "private-notes", "hunter2", "Expecting value"):
        assert private not in text
    reasons = {r.value for r in QuarantineReason} | {"other"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert set(s.labels) <= {"job_id", "rank", "replica", "reason", "phase", "mode",
                                     "epoch"}, s
            assert s.labels.get("reason", "bad_json") in reasons
            assert s.labels.get("job_id", JOB) == JOB and s.labels.get("rank", "0").isdigit()
