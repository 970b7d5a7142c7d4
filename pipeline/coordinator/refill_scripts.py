"""The Lua scripts of a refill job (docs/refill.md, docs/redis-schema.md "refill jobs").

Same conventions as `scripts.py` (files `lua/refill_*.lua`): validate before the first write,
times from the Redis clock, errors as replies starting with a code. Keys are derived inside Lua
from the job's base (`ARGV[1]`, e.g. `odb:v1:{job}:`) like the step keys, so they stay in the
job's hash slot (REGISTER aside: like the training jobs' one it names the registry's keys).
Admission follows `pipeline.refill.admission.admit` and the lease table follows
`pipeline.refill.leases.LeaseTable` rule for rule; tests/refill compares them.

A request's info is "cost,seq,over,prompt,generation" (over = 1: flagged over budget, admitted
only alone to an idle consumer; seq = epoch * 2**32 + source row, `pipeline.refill.request`).
"""

from __future__ import annotations

from pipeline.coordinator.scripts import Script

open_consumer = Script.named("refill_open")
refill = Script.named("refill_refill")
producer = Script.named("refill_producer")
enqueue = Script.named("refill_enqueue")
register_job = Script.named("refill_register")
