"""`JobStatus` as GetJob's reply (`odb.v1.JobStatus`) and back (the status client reads a
GetJob answer into the same value).

The wire carries the job-wide positions and this replica's connections, not the emission totals,
rates or quarantine records (those are on the metrics port's `/status.json`): what the reply
lacks reads back as None. On the wire -1 means "none" for steps and seconds.
"""

from __future__ import annotations

from pipeline.modes import JobMode
from pipeline.observability.job_status import (
    EpochEndStatus,
    JobStatus,
    MemberStatus,
    MixChangeStatus,
    MixtureStatus,
    QuarantineStatus,
    RankOnReplica,
    RankStatus,
    RefillEpoch,
    RefillStatus,
    ReplicaStatus,
    SourceShareStatus,
    WorldStatus,
)
from pipeline.observability.status_view import refill_state, training_state
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

_MODE = {JobMode.JOIN: pb.JOIN, JobMode.QUOTA: pb.QUOTA, JobMode.REFILL: pb.REFILL}
_MODE_OF = {wire: mode for mode, wire in _MODE.items()}


def _none(x: float) -> float | None:
    return None if x < 0 else x


def to_proto(job: JobStatus) -> pb.JobStatus:
    out = pb.JobStatus(
        job_id=job.job_id, world_size=job.world_size or 0, mode=_MODE[job.mode],
        epochs=job.epochs or 0,
        published_through=-1 if job.published_through is None else job.published_through,
        done=job.done, samples_in=job.samples_in or 0,
        quarantined=job.quarantine.total if job.quarantine else 0,
        lapsed_ranks=list(job.lapsed_ranks or ()), error=job.error or "",
        replica_id=job.replica.id if job.replica else "",
        reconfiguring=bool(job.reconfiguring), open=bool(job.open),
        batch_size_notice=job.batch_size_notice or "")
    for r in job.ranks or ():
        rep = r.replica
        rank = out.ranks.add(rank=r.rank, acked_step=r.acked_step, client_id=r.client_id or "",
                             connected=bool(rep and rep.connected),
                             delivered_step=rep.delivered_step if rep else -1)
        for m in r.members or ():
            mr = m.replica
            rank.members.add(member=m.member, client_id=m.client_id or "",
                             acked_step=m.acked_step, lag_steps=m.lag_steps,
                             connected=bool(mr and mr.connected),
                             delivered_step=mr.delivered_step if mr else -1,
                             lapsed_seconds=m.lapsed_for_s or 0.0, released=m.released)
    for e in job.epoch_ends or ():
        out.epoch_ends.add(epoch=e.epoch, steps=e.steps, final_step=list(e.final_step),
                           carried_over=e.carried_over)
    for w in job.worlds or ():
        out.worlds.add(
            generation=w.generation, world_size=w.world_size, first_step=w.first_step,
            last_step=-1 if w.last_step is None else w.last_step,
            rank_last_steps=list(w.rank_last_steps), reason=w.reason,
            requested_at=w.requested_at, returned_samples=w.returned_samples,
            adopted_seconds=-1.0 if w.adopted_s is None else w.adopted_s,
            first_batch_seconds=-1.0 if w.first_batch_s is None else w.first_batch_s)
    mix = job.sources
    if mix is not None:
        out.sources.CopyFrom(pb.MixtureStatus(
            epoch=mix.epoch, mix_by=mix.mix_by,
            sources=[pb.SourceShare(name=x.name, samples=x.samples, loss_tokens=x.loss_tokens,
                                    quarantined=x.quarantined, share=x.share, target=x.target)
                     for x in mix.sources],
            changes=[pb.MixChange(step=c.step, by=c.by, weights=dict(c.weights))
                     for c in mix.changes]))
    rf = job.refill
    if rf is not None:
        out.refill.CopyFrom(pb.RefillCounts(
            enqueued=rf.enqueued, waiting=rf.waiting, in_flight=rf.in_flight,
            completed=rf.completed, readmitted=rf.readmitted, admitted=rf.admitted,
            quarantined=rf.quarantined, consumers=rf.consumers, exhausted=rf.exhausted,
            lease_lapses=rf.lease_lapses, epoch=rf.epoch, epochs=rf.epochs or 0,
            by_epoch=[pb.RefillEpochCounts(epoch=e.epoch, enqueued=e.enqueued,
                                           completed=e.completed, quarantined=e.quarantined)
                      for e in rf.by_epoch]))
    return out


def from_proto(m: pb.JobStatus) -> JobStatus:
    common = {"job_id": m.job_id, "mode": _MODE_OF[m.mode], "done": m.done,
              "error": m.error or None, "open": m.open, "epochs": m.epochs or None,
              "samples_in": m.samples_in,
              "quarantine": QuarantineStatus(m.quarantined),
              "replica": ReplicaStatus(m.replica_id) if m.replica_id else None}
    if m.HasField("refill"):
        c = m.refill
        return JobStatus(**common, state=refill_state(m.done), refill=RefillStatus(
            enqueued=c.enqueued, waiting=c.waiting, in_flight=c.in_flight,
            completed=c.completed, readmitted=c.readmitted, admitted=c.admitted,
            quarantined=c.quarantined, consumers=c.consumers, exhausted=c.exhausted,
            lease_lapses=c.lease_lapses, epoch=c.epoch, epochs=c.epochs or None,
            by_epoch=tuple(RefillEpoch(e.epoch, e.enqueued, e.completed, e.quarantined)
                           for e in c.by_epoch)))
    ranks = tuple(RankStatus(rank=r.rank, acked_step=r.acked_step, client_id=r.client_id,
                             lapsed=r.rank in m.lapsed_ranks,
                             replica=RankOnReplica(r.connected, r.delivered_step),
                             members=tuple(MemberStatus(
                                 x.member, x.client_id or None, x.acked_step, x.lag_steps,
                                 x.lapsed_seconds, released=x.released,
                                 replica=RankOnReplica(x.connected, x.delivered_step))
                                 for x in r.members) or None)
                  for r in m.ranks)
    ends = tuple(EpochEndStatus(e.epoch, e.steps, tuple(e.final_step), e.carried_over)
                 for e in m.epoch_ends)
    return JobStatus(
        **common,
        state=training_state(error=m.error or None, done=m.done,
                             published_through=m.published_through,
                             final_steps=ends[-1].final_step if m.done and ends else None,
                             acked=[r.acked_step for r in ranks],
                             holders=[r.client_id for r in ranks]),
        world_size=m.world_size, published_through=m.published_through, ranks=ranks,
        lapsed_ranks=tuple(m.lapsed_ranks), reconfiguring=m.reconfiguring, epoch_ends=ends,
        batch_size_notice=m.batch_size_notice or None,
        sources=_mixture(m.sources) if m.HasField("sources") else None,
        worlds=tuple(WorldStatus(
            generation=w.generation, world_size=w.world_size, first_step=w.first_step,
            last_step=None if w.last_step < 0 else w.last_step,
            rank_last_steps=tuple(w.rank_last_steps), reason=w.reason,
            requested_at=w.requested_at, returned_samples=w.returned_samples,
            adopted_s=_none(w.adopted_seconds), first_batch_s=_none(w.first_batch_seconds))
            for w in m.worlds))


def _mixture(m: pb.MixtureStatus) -> MixtureStatus:
    return MixtureStatus(
        m.epoch, m.mix_by,
        tuple(SourceShareStatus(x.name, x.samples, x.loss_tokens, x.quarantined, x.share,
                                x.target) for x in m.sources),
        tuple(MixChangeStatus(c.step, c.by, dict(c.weights)) for c in m.changes))
