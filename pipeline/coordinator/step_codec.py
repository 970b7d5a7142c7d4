"""Step, EpochEnd and PlannerCheckpoint <-> compact bytes (JSON, short keys; msgpack is absent).

A step is stored as one header plus one blob per rank, so a server replica fetches only the
batches of the ranks it serves (one HMGET) instead of the whole W-rank step. The encoding is
canonical (equal values give equal bytes) because write-once compares digests of these bytes:
`truncated_to` is written as sorted pairs (its keys may be ints, and dict order is not value).
Sample ids keep their type (int or str) through JSON.

World stamps ("w": [generation, size]) are written for stamped steps and ENDs only, so an
unstamped value encodes as before stamping. A record a build before stamping published decodes
with `WorldStamp()` (not stamped); `RedisJobState` derives its stamp from the job's worlds
(`worlds.stamp_of_step` / `stamp_of_end`) when it reads it.

A step balanced by a fitted compute model records it ("m": coefficients, error, reports); a step
balanced by tokens has no "m", so it encodes as before compute balancing existed.

Global steps (docs/global-steps.md): the header's "i" gains the step's `optimizer_step` as a
fourth number, and a rank with several micro-batches is still one blob: "s" holds its samples of
every micro-batch in order and "t" all their truncations (what the SCALE script reads), and "u"
cuts them into micro-batches, `[[samples, cost(, 1 over budget)], ...]` in micro order, in
place of "c" and "o". A rank with one micro-batch, and every step without a global token budget,
encode as before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.jobstate.interface import PlannerCheckpoint, QuarantineEntry
from pipeline.jobstate.worlds import ScaleReason, World
from pipeline.planner.compute_fit import ComputeModel
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Step, StepInfo, WorldStamp

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False).encode


def _sid(sample_id: Any) -> int | str:
    # numpy ints and bools would otherwise break JSON or change type on the way back.
    return sample_id if isinstance(sample_id, str) else int(sample_id)


def _sid_key(sample_id: int | str) -> tuple[bool, int | str]:
    return (isinstance(sample_id, str), sample_id)


def _sample(s: MeasuredSample) -> list:
    # [id, tokens, visual, loss, mixture source] without trailing zeros (canonical: one encoding
    # per value; a sample of a job without a mixture encodes as before sources existed).
    out = [_sid(s.sample_id), int(s.num_tokens), int(s.num_visual_tokens), int(s.loss_tokens),
           int(s.source)]
    while len(out) > 2 and out[-1] == 0:
        out.pop()
    return out


def _unsample(v: list) -> MeasuredSample:
    return MeasuredSample(v[0], v[1], *v[2:5])


def _truncations(micros: Sequence[Batch]) -> list[list]:
    pairs = sorted(((_sid(k), int(v)) for b in micros for k, v in b.truncated_to.items()),
                   key=lambda kv: _sid_key(kv[0]))
    return [list(p) for p in pairs]


def encode_rank(micros: Sequence[Batch]) -> bytes:
    """One rank's batches of a step (its micro-batches in order) as its blob."""
    if not micros or [b.micro for b in micros] != list(range(len(micros))):
        raise ValueError(f"a rank's batches are its micro-batches 0..n-1 in order, got micros "
                         f"{[b.micro for b in micros]}")
    if any(b.filler for b in micros) and len(micros) > 1:
        raise ValueError("a filler is a rank's only batch of its step")
    d: dict[str, Any] = {"s": [_sample(s) for b in micros for s in b.samples]}
    if len(micros) == 1:
        d["c"] = int(micros[0].cost)
        if micros[0].over_budget:
            d["o"] = 1
    else:
        d["u"] = [[len(b.samples), int(b.cost), 1] if b.over_budget
                  else [len(b.samples), int(b.cost)] for b in micros]
    if micros[0].filler:
        d["f"] = 1
    t = _truncations(micros)
    if t:
        d["t"] = t
    return _dumps(d).encode()


def decode_rank(data: bytes, rank: int) -> tuple[Batch, ...]:
    """A rank's blob as its batches of the step, in micro-batch order."""
    d = json.loads(data)
    samples = [_unsample(v) for v in d["s"]]
    cut = {k: v for k, v in d.get("t", ())}
    filler = bool(d.get("f", 0))
    if "u" not in d:
        return (Batch(rank=rank, samples=tuple(samples), cost=d["c"],
                      over_budget=bool(d.get("o", 0)), filler=filler, truncated_to=cut),)
    out = []
    at = 0
    for m, (n, cost, *o) in enumerate(d["u"]):
        mine = tuple(samples[at:at + n])
        at += n
        ids = {s.sample_id for s in mine}
        out.append(Batch(rank=rank, samples=mine, cost=cost, over_budget=bool(o and o[0]),
                         filler=filler, micro=m,
                         truncated_to={k: v for k, v in cut.items() if k in ids}))
    return tuple(out)


def _stamp(d: dict[str, Any], world: WorldStamp) -> dict[str, Any]:
    if world.stamped:
        d["w"] = [int(world.generation), int(world.size)]
    return d


def _unstamp(d: dict) -> WorldStamp:
    w = d.get("w")
    return WorldStamp() if w is None else WorldStamp(*w)


def encode_header(step: Step) -> bytes:
    # "r": rank order of `batches` as published, so decoding rebuilds an equal tuple.
    d = _stamp({
        "e": int(step.epoch), "n": int(step.step),
        "i": _info(step.info),
        "r": _ranks(step),
    }, step.world)
    if step.compute is not None:
        d["m"] = step.compute.to_list()
    return _dumps(d).encode()


def _info(info: StepInfo) -> list[int]:
    out = [int(info.step_samples), int(info.step_tokens), int(info.step_loss_tokens)]
    if info.optimizer_step is not None:
        out.append(int(info.optimizer_step))
    return out


def _ranks(step: Step) -> list[int]:
    """The ranks of `step.batches` in their order, each once (its micro-batches are together)."""
    ranks: list[int] = []
    for b in step.batches:
        if not ranks or ranks[-1] != b.rank:
            if b.rank in ranks:
                raise ValueError(f"step {step.step}: rank {b.rank}'s batches are not together "
                                 f"in batches: {[x.rank for x in step.batches]}")
            ranks.append(int(b.rank))
    return ranks


def decode_header(data: bytes) -> dict:
    return json.loads(data)


def header_compute(h: dict) -> ComputeModel | None:
    """The compute model a decoded header's step was balanced by (None: by tokens)."""
    m = h.get("m")
    return None if m is None else ComputeModel.from_list(m)


def header_world(h: dict) -> WorldStamp:
    """The world stamp of a decoded header (`WorldStamp()`: published before stamping)."""
    return _unstamp(h)


def encode_step(step: Step) -> tuple[bytes, list[tuple[int, bytes]]]:
    """(header, [(rank, its blob), ...] in the step's rank order)."""
    if step.info.optimizer_step is None and len(step.ranks()) != len(step.batches):
        raise ValueError(f"step {step.step}: a rank appears twice in batches: "
                         f"{[b.rank for b in step.batches]}")
    return encode_header(step), [(r, encode_rank(step.micros_for(r))) for r in _ranks(step)]


def decode_step(header: bytes, blobs: dict[int, bytes]) -> Step:
    h = decode_header(header)
    return Step(
        epoch=h["e"], step=h["n"],
        batches=tuple(b for r in h["r"] for b in decode_rank(blobs[r], r)),
        info=StepInfo(*h["i"]), world=_unstamp(h), compute=header_compute(h),
    )


def encode_epoch_end(end: EpochEnd) -> bytes:
    return _dumps(_stamp({
        "e": int(end.epoch), "n": int(end.steps),
        "f": [None if s is None else int(s) for s in end.final_step],
        "c": [_sample(s) for s in end.carried_over],
    }, end.world)).encode()


def decode_epoch_end(data: bytes) -> EpochEnd:
    d = json.loads(data)
    return EpochEnd(epoch=d["e"], final_step=tuple(d["f"]), steps=d["n"],
                    carried_over=tuple(_unsample(v) for v in d["c"]), world=_unstamp(d))


def encode_checkpoint(c: PlannerCheckpoint) -> bytes:
    # The opaque state is bytes (planner JSON); latin-1 maps every byte to one code point.
    d = {"e": int(c.epoch), "c": int(c.samples_consumed), "n": int(c.next_step),
         "s": c.state.decode("latin-1")}
    if c.world:
        d["w"] = int(c.world)
    if c.order:  # the order's cursor: absent for a job that never changed its mixture
        d["o"] = c.order.decode("latin-1")
    return _dumps(d).encode()


def decode_checkpoint(data: bytes) -> PlannerCheckpoint:
    d = json.loads(data)
    return PlannerCheckpoint(epoch=d["e"], samples_consumed=d["c"], next_step=d["n"],
                             state=d["s"].encode("latin-1"), world=d.get("w", 0),
                             order=d.get("o", "").encode("latin-1"))


def decode_world(data: bytes) -> World:
    """A world record of the `worlds` hash (written by the SCALE script)."""
    d = json.loads(data)
    ls = d.get("l")
    return World(generation=d["g"], world_size=d["n"], first_step=d["f"],
                 reason=ScaleReason(d["r"]), requested_at=d["t"] / 1000.0,
                 last_steps=None if ls is None else tuple(int(x) for x in ls),
                 published_through=d.get("p", -1), live_ranks=tuple(d.get("v", ())),
                 returned_samples=d.get("rs", 0), returned_tokens=d.get("rt", 0))


def encode_quarantine(q: QuarantineEntry) -> bytes:
    return _dumps({"i": q.sample_id, "r": q.reason, "d": q.detail}).encode()


def decode_quarantine(data: bytes) -> QuarantineEntry:
    d = json.loads(data)
    return QuarantineEntry(d["i"], d["r"], d["d"])
