"""A rank served to a model-parallel group shows its members on every surface: the typed status
(every member's client, position and lag behind its group's most advanced member, a lost one
lapsed, this replica's stream of each), GetJob's reply and back, `/status.json` and back, the
`status` text and the HTML page."""

from __future__ import annotations

import json

from jobstate.builders import publication, steps

from pipeline.jobstate import MemoryJobState, RankAck
from pipeline.jobstate.interface import Member
from pipeline.observability.job_status import ServiceStatus
from pipeline.observability.metrics import OdbCollector
from pipeline.observability.status_json import job_from_dict, job_to_dict
from pipeline.observability.status_page import render as render_page
from pipeline.observability.status_proto import from_proto, to_proto
from pipeline.observability.status_view import training_job_status
from pipeline.service.job_runtime import RankConnection, ReplicaFacts
from pipeline.status.report import StatusReport
from pipeline.status.text import render as render_text
from trainer_client.wire.odb.v1 import data_service_pb2 as pb


def grouped_job():
    clock = [1000.0]
    st = MemoryJobState("g", 2, "join", clock=lambda: clock[0])
    gen = st.claim_producer("p", 600)
    st.publish(publication(steps(0, 5, world_size=2)), fence=gen)
    st.grant([(0, r, 5) for r in range(2)])
    m0, m1 = Member(0, 2), Member(1, 2)
    st.claim_rank(0, "tp0", 60, member=m0)
    st.claim_rank(0, "tp1", 5, member=m1)
    st.ack_many([RankAck(0, "tp0", 4, member=m0), RankAck(0, "tp1", 1, member=m1, renew=False)],
                60)
    st.claim_rank(1, "solo", 60)
    clock[0] += 10  # tp1 went silent: its seat (and its group's lease) lapsed
    facts = ReplicaFacts(ranks={1: RankConnection("solo", True, 3)}, fetched_by_rank={0: 9},
                         uptime_s=5.0,
                         members={(0, 0): RankConnection("tp0", True, 5),
                                  (0, 1): RankConnection("tp1", False, 2)})
    return training_job_status("g", st, facts=facts, replica_id="r1")


def test_members_on_every_surface():
    job = grouped_job()
    r0, r1 = job.ranks
    assert r0.client_id == "group:2" and r0.acked_step == 1 and r0.lapsed
    assert r1.members is None and r1.client_id == "solo"
    a, b = r0.members
    assert (a.member, a.client_id, a.acked_step, a.lag_steps) == (0, "tp0", 4, 0)
    assert (b.member, b.client_id, b.acked_step, b.lag_steps) == (1, "tp1", 1, 3)
    assert not a.lapsed_for_s and b.lapsed_for_s > 0
    assert (a.replica.connected, a.replica.delivered_step) == (True, 5)
    assert (b.replica.connected, b.replica.delivered_step) == (False, 2)
    assert (r0.replica.connected, r0.replica.delivered_step) == (True, 5)  # the group's here

    back = from_proto(pb.JobStatus.FromString(to_proto(job).SerializeToString()))
    assert [(m.member, m.client_id, m.acked_step, m.lag_steps, m.replica.connected,
             m.replica.delivered_step, m.lapsed_for_s > 0) for m in back.ranks[0].members] == [
        (0, "tp0", 4, 0, True, 5, False), (1, "tp1", 1, 3, False, 2, True)]
    assert back.ranks[1].members is None

    assert job_from_dict(json.loads(json.dumps(job_to_dict(job)))) == job
    assert job_to_dict(job)["ranks"][0]["members"][1]["client_id"] == "tp1"

    text = render_text(StatusReport(0.0, {}, (job,)))
    rows = {line.split()[0]: line for line in text.splitlines()[1:] if line.startswith("  0")}
    assert "tp0" in rows["0.0"] and "tp1" in rows["0.1"] and "group:2" in rows["0"]
    assert "member m of rank r's group" in text

    page = render_page(ServiceStatus(0.0, 0.0, "r1", (job,)))
    assert 'data-rank="0" data-member="1" class="member is-lapsed"' in page
    assert ">tp1<" in page and ">0.1<" in page

    class View:  # the collector's source: this job's status
        started_at = 0.0

        def status(self):
            return ServiceStatus(0.0, 0.0, "r1", (job,))

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in OdbCollector(View()).collect() for s in fam.samples}
    key = (("job_id", "g"), ("member", "1"), ("rank", "0"))
    assert samples[("odb_member_lag_steps", key)] == 3
    assert samples[("odb_member_lapsed", key)] == 1
    assert not any("tp1" in str(k) for k in samples), "client ids are never labels"
