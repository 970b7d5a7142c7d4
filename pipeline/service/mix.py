"""The Mix call: a mixture job's new weights, asked for while it runs (docs/data-order.md).

Checks the request against the job's mixture (every source named, each weight >= 0, a positive
sum: `BadRequest`; a job without a mixture or fully planned: `MixRefused`) and records it in the
job's state; the producer applies it at its next step boundary, for every rank at once
(producer/mixing.py), and the change shows in status (`sources.changes`, "mix <seq>").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pipeline.errors import BadRequest, MixRefused
from pipeline.jobstate.interface import MixRequest
from pipeline.order.mixture import MixtureError, check_weights
from pipeline.service.job_runtime import JobRuntime
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)


def mix(rt: JobRuntime, weights: Mapping[str, float]) -> MixRequest:
    job = rt.job
    source = job.source
    if source.mixture is None:
        raise MixRefused(f"job {job.job_id!r} has no source.mixture: `mix` changes the weights "
                         "of a mixture's named sources, and this job reads one source")
    try:
        check_weights(source.mixture_value().names, dict(weights), "weights")
    except MixtureError as exc:
        raise BadRequest(f"job {job.job_id!r}: {exc}") from None
    if rt.state.is_done():
        raise MixRefused(f"job {job.job_id!r} is fully planned: no step is left to plan with "
                         "new weights")
    request = rt.state.request_mix(weights)
    log.info("job %s: mixture change %d asked for: %s", job.job_id, request.seq,
             ", ".join(f"{n}={w:g}" for n, w in request.weights.items()),
             extra={"job": job.job_id})
    return request


def mix_reply(rt: JobRuntime, request: MixRequest) -> pb.MixReply:
    return pb.MixReply(job_id=rt.job.job_id, seq=request.seq, weights=dict(request.weights))
