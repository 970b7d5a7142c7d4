"""The Lua scripts of a refill job (docs/refill.md, docs/redis-schema.md "refill jobs").

Same conventions as `scripts.py`: validate before the first write, times from the Redis clock,
errors as replies starting with a code. Keys are derived inside Lua from the job's base
(`ARGV[1]`, e.g. `odb:v1:{job}:`) like the step keys, so they stay in the job's hash slot.
Admission follows `pipeline.refill.admission.admit` and the lease table follows
`pipeline.refill.leases.LeaseTable` rule for rule; tests/refill compares them.

A request's info is "cost,seq,over,prompt,generation" (over = 1: flagged over budget, admitted
only alone to an idle consumer).
"""

from __future__ import annotations

from pipeline.coordinator.scripts import _NOW, Script

# Shared helpers: re-admit a consumer's leases (but `keep`), and every expired consumer's.
_HELPERS = """
local base = ARGV[1]
local K_INFO, K_WAIT = base .. 'refill:info', base .. 'refill:wait'
local K_OWNER, K_CONS = base .. 'refill:owner', base .. 'refill:consumers'
local K_DONE, K_CNT = base .. 'refill:done', base .. 'refill:counters'
local function info_of(id)
  local s = redis.call('HGET', K_INFO, id)
  if not s then return nil end
  local cost, seq, over = string.match(s, '^(%d+),(%d+),(%d)')
  return tonumber(cost), tonumber(seq), over == '1'
end
-- `refill:calls` holds each consumer's last ask as JSON [call_seq, admitted, completed, stale].
local function release(consumer, keep)
  local held = base .. 'refill:held:' .. consumer
  local n = 0
  for _, id in ipairs(redis.call('SMEMBERS', held)) do
    if not keep[id] then
      redis.call('SREM', held, id)
      redis.call('HDEL', K_OWNER, id)
      local _, seq = info_of(id)
      redis.call('ZADD', K_WAIT, seq, id)
      n = n + 1
    end
  end
  if n > 0 then redis.call('HINCRBY', K_CNT, 'readmitted', n) end
  return n
end
-- An expired consumer's last reply stays on record: an ask it retries after a long outage
-- must get that reply again (its finished ids were recorded; applied afresh they would come
-- back neither completed nor stale). Its next ask or open replaces or drops it.
local function expire(t)
  for _, c in ipairs(redis.call('ZRANGEBYSCORE', K_CONS, '-inf', t)) do
    release(c, {})
    redis.call('ZREM', K_CONS, c)
  end
end
"""

# ARGV: base, consumer, lease_ms, retry_seq, held ids...
# Re-admits the consumer's leases it no longer holds (a restarted consumer: all of them), renews
# the rest. The admission of ask `retry_seq` (a retried ask whose reply was lost) is held too,
# and stays on record for the retry; any other ask's record is dropped. Returns the number
# released.
OPEN = _NOW + _HELPERS + """
local consumer, lease, retry = ARGV[2], tonumber(ARGV[3]), ARGV[4]
expire(now)
local keep = {}
for i = 5, #ARGV do keep[ARGV[i]] = true end
local K_CALLS = base .. 'refill:calls'
local prev = redis.call('HGET', K_CALLS, consumer)
if prev then
  local rec = cjson.decode(prev)
  if rec[1] == retry then
    for _, id in ipairs(rec[2]) do keep[id] = true end
  else
    redis.call('HDEL', K_CALLS, consumer)
  end
end
local n = release(consumer, keep)
redis.call('ZADD', K_CONS, now + lease, consumer)
return n
"""

# ARGV: base, consumer, lease_ms, free_tokens, scan, call_seq, n_finished, finished ids...
# Reply: {'ok', admitted ids (array), completed ids, stale ids} or
#        {'rejected', unknown ids, twice ids} (nothing applied) or
#        a retried call (same call_seq): the very reply of the first time, from the record.
REFILL = _NOW + _HELPERS + """
local consumer, lease = ARGV[2], tonumber(ARGV[3])
local free, scan, call = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local nf = tonumber(ARGV[7])
local prev = redis.call('HGET', base .. 'refill:calls', consumer)
if prev then
  local rec = cjson.decode(prev)
  if rec[1] == call then
    redis.call('ZADD', K_CONS, now + lease, consumer)
    return {'ok', rec[2], rec[3], rec[4]}
  end
end
local unknown, twice, seen = {}, {}, {}
for i = 8, 7 + nf do
  local id = ARGV[i]
  if redis.call('HEXISTS', K_INFO, id) == 0 then unknown[#unknown + 1] = id
  elseif seen[id] then twice[#twice + 1] = id end
  seen[id] = true
end
if #unknown > 0 or #twice > 0 then return {'rejected', unknown, twice} end
expire(now)
local completed, stale = {}, {}
for i = 8, 7 + nf do
  local id = ARGV[i]
  local by = redis.call('HGET', K_DONE, id)
  local owner = redis.call('HGET', K_OWNER, id)
  if by then
    if by ~= consumer then stale[#stale + 1] = id end
  elseif owner and owner ~= consumer then
    stale[#stale + 1] = id
  else
    if owner then
      redis.call('HDEL', K_OWNER, id)
      redis.call('SREM', base .. 'refill:held:' .. owner, id)
    end
    redis.call('ZREM', K_WAIT, id)
    redis.call('HSET', K_DONE, id, consumer)
    completed[#completed + 1] = id
  end
end
redis.call('ZADD', K_CONS, now + lease, consumer)
local held = base .. 'refill:held:' .. consumer
local idle = redis.call('SCARD', held) == 0
local admitted = {}
if free > 0 then
  local left = free
  for _, id in ipairs(redis.call('ZRANGE', K_WAIT, 0, scan - 1)) do
    if left <= 0 then break end
    local cost, _, over = info_of(id)
    if over then
      if idle and #admitted == 0 then admitted = {id}; break end
    elseif cost <= left then
      admitted[#admitted + 1] = id
      left = left - cost
    end
  end
  for _, id in ipairs(admitted) do
    redis.call('ZREM', K_WAIT, id)
    redis.call('HSET', K_OWNER, id, consumer)
    redis.call('SADD', held, id)
  end
  if #admitted > 0 then redis.call('HINCRBY', K_CNT, 'admitted', #admitted) end
end
redis.call('HSET', base .. 'refill:calls', consumer,
  cjson.encode({call, admitted, completed, stale}))
return {'ok', admitted, completed, stale}
"""

# ARGV: base, holder, lease_ms.  The producer lease: 1 if `holder` holds it now (taken or renewed).
PRODUCER = _NOW + """
local meta = ARGV[1] .. 'refill:meta'
local m = redis.call('HMGET', meta, 'producer', 'producer_exp')
if m[1] and m[1] ~= ARGV[2] and tonumber(m[2]) > now then return 0 end
redis.call('HSET', meta, 'producer', ARGV[2], 'producer_exp', now + tonumber(ARGV[3]))
return 1
"""

# ARGV: base, holder, cursor (next source row), exhausted (0|1), n_requests, n_quarantined,
#       then n_requests triples (id, info, payload), then n_quarantined JSON entries.
# Fenced: refused (0) unless `holder` holds the producer lease; the cursor only moves forward,
# so rows re-read by a restarted producer never enqueue a request twice.
ENQUEUE = _NOW + """
local base = ARGV[1]
local meta = base .. 'refill:meta'
local m = redis.call('HMGET', meta, 'producer', 'producer_exp', 'cursor')
if m[1] ~= ARGV[2] or tonumber(m[2]) <= now then return 0 end
local cursor = tonumber(ARGV[3])
if cursor < tonumber(m[3] or '0') then return 0 end
local nr, nq = tonumber(ARGV[5]), tonumber(ARGV[6])
local added = 0
for i = 0, nr - 1 do
  local id, info, payload = ARGV[7 + 3 * i], ARGV[8 + 3 * i], ARGV[9 + 3 * i]
  if redis.call('HSETNX', base .. 'refill:info', id, info) == 1 then
    redis.call('HSET', base .. 'refill:req', id, payload)
    redis.call('ZADD', base .. 'refill:wait', tonumber(string.match(info, '^%d+,(%d+)')), id)
    added = added + 1
  end
end
local q = base .. 'refill:quarantine'
for i = 0, nq - 1 do
  if redis.call('LLEN', q) < 1000 then redis.call('RPUSH', q, ARGV[7 + 3 * nr + i]) end
end
if added > 0 then redis.call('HINCRBY', base .. 'refill:counters', 'enqueued', added) end
if nq > 0 then redis.call('HINCRBY', base .. 'refill:counters', 'quarantined', nq) end
redis.call('HSET', meta, 'cursor', cursor, 'exhausted', ARGV[4])
return 1
"""

open_consumer = Script(OPEN)
refill = Script(REFILL)
producer = Script(PRODUCER)
enqueue = Script(ENQUEUE)
