"""Step <-> bytes: lossless, canonical (equal values give equal bytes, whatever dict order);
records published before world stamps still decode (unstamped)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.coordinator import step_codec
from pipeline.jobstate import PlannerCheckpoint, QuarantineEntry
from pipeline.planner.compute_fit import FEATURES, ComputeModel
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Step, StepInfo, WorldStamp

sample_ids = st.one_of(st.integers(-(2**40), 2**40), st.text(min_size=0, max_size=12))
samples = st.builds(MeasuredSample, sample_ids, st.integers(0, 10**6), st.integers(0, 5000))


@st.composite
def steps(draw):
    w = draw(st.integers(1, 6))
    ranks = draw(st.permutations(range(w)))[: draw(st.integers(0, w))]
    batches = []
    for r in ranks:
        ss = tuple(draw(st.lists(samples, max_size=4)))
        trunc = {s.sample_id: draw(st.integers(0, 100)) for s in ss if draw(st.booleans())}
        batches.append(Batch(r, ss, draw(st.integers(0, 10**7)), draw(st.booleans()), trunc,
                             filler=draw(st.booleans())))
    world = WorldStamp(draw(st.integers(0, 9)), w) if draw(st.booleans()) else WorldStamp()
    compute = draw(st.one_of(st.none(), st.builds(
        ComputeModel, st.tuples(*[st.floats(0, 1, allow_subnormal=True)] * len(FEATURES)),
        st.floats(0, 1), st.integers(0, 10**4))))
    return Step(draw(st.integers(0, 50)), draw(st.integers(0, 10**6)), tuple(batches),
                StepInfo(draw(st.integers(0, 10**4)), draw(st.integers(0, 10**8))), world,
                compute)


@settings(max_examples=150, deadline=None)
@given(steps())
def test_step_round_trip_is_lossless_and_canonical(step):
    header, blobs = step_codec.encode_step(step)
    back = step_codec.decode_step(header, dict(blobs))
    assert back == step
    for b, b2 in zip(step.batches, back.batches, strict=True):
        assert [type(s.sample_id) for s in b.samples] == [type(s.sample_id) for s in b2.samples]
    # Same value, reversed dict insertion order: identical bytes (write-once compares bytes).
    rev = Step(step.epoch, step.step, tuple(
        Batch(b.rank, b.samples, b.cost, b.over_budget, dict(reversed(b.truncated_to.items())),
              b.filler)
        for b in step.batches), step.info, step.world, step.compute)
    assert step_codec.encode_step(rev) == (header, blobs)
    # A step balanced by tokens encodes as before compute balancing existed (no "m").
    assert (b'"m":' in header) == (step.compute is not None)


def test_epoch_end_and_checkpoint_round_trip():
    end = EpochEnd(3, (7, None, 9), 5, (MeasuredSample("a", 3), MeasuredSample(4, 5, 6)),
                   WorldStamp(2, 3))
    assert step_codec.decode_epoch_end(step_codec.encode_epoch_end(end)) == end
    ck = PlannerCheckpoint(2, 100, 17, bytes(range(256)))
    assert step_codec.decode_checkpoint(step_codec.encode_checkpoint(ck)) == ck


@settings(max_examples=100, deadline=None)
@given(st.builds(QuarantineEntry, st.text(max_size=20), st.text(max_size=12),
                 st.text(max_size=40)))
def test_quarantine_entry_round_trip(entry):
    assert step_codec.decode_quarantine(step_codec.encode_quarantine(entry)) == entry


def test_encoding_is_compact():
    step = Step(0, 12, tuple(Batch(r, (MeasuredSample(f"s:{r}", 900),), 900) for r in range(8)),
                StepInfo(8, 7200))
    header, blobs = step_codec.encode_step(step)
    assert len(header) < 60
    assert all(len(b) < 30 for _, b in blobs)  # {"s":[["s:0",900]],"c":900}


def test_records_published_before_stamps_decode_unstamped():
    """The exact bytes a build before world stamps wrote: they decode, unstamped (the job's
    state then derives the world: tests/jobstate/test_worlds.py)."""
    header = b'{"e":1,"n":12,"i":[2,30,0],"r":[1,0]}'
    step = step_codec.decode_step(header, {0: b'{"s":[["a",10]],"c":10}',
                                           1: b'{"s":[["b",20]],"c":20}'})
    assert (step.step, [b.rank for b in step.batches], step.world) == (12, [1, 0], WorldStamp())
    end = step_codec.decode_epoch_end(b'{"e":0,"n":5,"f":[4,null],"c":[]}')
    assert (end.final_step, end.world, end.world.stamped) == ((4, None), WorldStamp(), False)
    # An unstamped value still encodes as those builds did (write-once compares the bytes).
    assert step_codec.encode_step(step)[0] == header


@st.composite
def global_steps(draw):
    """Global steps: each rank's micro-batches (1-3; a filler is a rank's only one), unique
    sample ids within a rank, the step's optimizer step."""
    w = draw(st.integers(1, 5))
    ids = iter(range(10**6))
    batches = []
    for r in range(w):
        filler = draw(st.booleans()) and draw(st.booleans())
        for m in range(1 if filler else draw(st.integers(1, 3))):
            ss = tuple(MeasuredSample(draw(st.sampled_from([next(ids), f"s:{next(ids)}"])),
                                      draw(st.integers(0, 10**5)), draw(st.integers(0, 9)))
                       for _ in range(draw(st.integers(1, 4))))
            trunc = {s.sample_id: draw(st.integers(0, 100)) for s in ss if draw(st.booleans())}
            batches.append(Batch(r, ss, draw(st.integers(0, 10**6)), draw(st.booleans()),
                                 trunc, filler=filler, micro=m))
    return Step(draw(st.integers(0, 50)), draw(st.integers(0, 10**6)), tuple(batches),
                StepInfo(draw(st.integers(0, 10**4)), draw(st.integers(0, 10**8)),
                         draw(st.integers(0, 10**8)), draw(st.integers(0, 10**6))),
                WorldStamp(draw(st.integers(0, 9)), w))


@settings(max_examples=150, deadline=None)
@given(global_steps())
def test_global_step_round_trip_one_blob_per_rank(step):
    header, blobs = step_codec.encode_step(step)
    assert [r for r, _ in blobs] == step.ranks()  # one record per rank, all its micro-batches
    back = step_codec.decode_step(header, dict(blobs))
    assert back == step
    assert back.info.optimizer_step == step.info.optimizer_step
    for r, blob in blobs:
        micros = step.micros_for(r)
        assert (b'"u":' in blob) == (len(micros) > 1)  # one micro-batch: encoded as before
        assert step_codec.decode_rank(blob, r) == micros


def test_a_step_without_global_steps_encodes_as_before():
    step = Step(0, 4, (Batch(0, (MeasuredSample("a", 3),), 3),
                       Batch(1, (MeasuredSample("b", 5, 0, 2),), 5, truncated_to={"b": 4})),
                StepInfo(2, 7, 2), WorldStamp(0, 2))
    header, blobs = step_codec.encode_step(step)
    assert header == b'{"e":0,"n":4,"i":[2,7,2],"r":[0,1],"w":[0,2]}'
    assert blobs == [(0, b'{"s":[["a",3]],"c":3}'),
                     (1, b'{"s":[["b",5,0,2]],"c":5,"t":[["b",4]]}')]
