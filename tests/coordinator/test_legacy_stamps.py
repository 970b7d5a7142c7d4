"""A Redis holding steps and ENDs published before world stamps (a build of the previous
schema, same keys) still serves: `RedisJobState` derives each record's world from the job's
world records (a step belongs to the last world starting at or before it; an END to the world
of its last step), exactly what the planner would have stamped."""

from __future__ import annotations

import json

from jobstate.builders import make_end, make_step, publication

from pipeline.jobstate import ScaleRequest
from pipeline.planner.types import WorldStamp


def _unstamp(client, key: str, field: str) -> None:
    d = json.loads(client.hget(key, field))
    d.pop("w")
    client.hset(key, field, json.dumps(d, separators=(",", ":")))


def test_records_without_a_stamp_get_the_world_they_were_published_in(new_state, redis_client):
    st = new_state(world_size=4)
    gen = st.claim_producer("p", 60)
    st.publish(publication([make_step(n, 4) for n in range(4)], rows=4), fence=gen)
    st.scale(ScaleRequest(2))  # nobody holds a lease: world 1 starts at step 4
    st.publish(publication([make_step(n, 2) for n in range(4, 7)], rows=9, world=1,
                           ends=(make_end(0, (6, 5), 7),)), fence=gen)
    stamped = [st.get_step(n) for n in range(7)], st.epoch_ends()
    for n in range(7):  # what a build before stamping wrote
        _unstamp(redis_client, st.keys.step(n), "h")
    _unstamp(redis_client, st.keys.ends, "0")
    assert redis_client.hget(st.keys.step(5), "h").find(b'"w"') == -1
    assert ([st.get_step(n) for n in range(7)], st.epoch_ends()) == stamped
    assert [s.world for s in stamped[0]] == [WorldStamp(0, 4)] * 4 + [WorldStamp(1, 2)] * 3
    assert stamped[1][0].world == WorldStamp(1, 2)
    got = st.get_steps_for([(2, [0]), (5, [1])])
    assert [s.world for s in got] == [WorldStamp(0, 4), WorldStamp(1, 2)]
