"""A replica rebuilds a batch by id (its producer gone, its object released) byte-identically,
also when the batch holds a sample of the previous epoch: carried over by quota mode, or
returned by a reconfiguration after its epoch's END and planned in the next epoch. With an
augmentation that changes a sample's length per epoch, only the previous epoch's payload
measures as planned; the replica must find it (as the producer's rebuild does), not fail."""

from __future__ import annotations

from pathlib import Path

from service_helpers import service_config

from pipeline.planner.types import Batch, Step, StepInfo, WorldStamp
from pipeline.preprocess.pipeline import SampleStore
from pipeline.service.payloads import RayPayloads

CHATS = str(Path(__file__).resolve().parents[2] / "pipeline" / "sample_data" / "chats.jsonl")


def test_a_sample_planned_in_the_next_epoch_is_rebuilt_from_its_own_epoch():
    job = service_config({
        "job_id": "aug", "world_size": 1, "source": {"paths": [CHATS]},
        "preprocess": {"augment": {"system_prompts": [
            "Be brief.", "You are a careful assistant who explains every step in detail, "
            "with examples, caveats and the reasons behind each of them."],
            "system_prompt_prob": 1.0}},
        "batching": {"token_budget": 16384}}).jobs[0]
    store = SampleStore(job)
    (source,) = store.files
    sid, m0 = next((s, store.get(s, 0).measured(job.batching.collate))
                   for s in (f"{source}:{i}" for i in range(40))
                   if store.get(s, 0).num_tokens != store.get(s, 1).num_tokens)
    # Planned in epoch 1 (after epoch 0's END), measured as epoch 0 made it.
    step = Step(1, 57, (Batch(0, (m0,), m0.num_tokens),), StepInfo(1, m0.num_tokens),
                WorldStamp(1, 1))
    payloads = RayPayloads(job, timeout_s=1.0)  # no producer to ask: rebuilt by id
    try:
        (got,) = payloads.fetch(step, 0)
    finally:
        payloads.close()
    assert got.digest() == store.get(sid, 0).digest() and payloads.rebuilt == 1
