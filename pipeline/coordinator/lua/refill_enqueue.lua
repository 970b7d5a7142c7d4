-- ARGV: base, holder, cursor (next source row), exhausted (0|1), n_requests, n_quarantined,
--       then n_requests triples (id, info, payload), then n_quarantined JSON entries.
-- Fenced: refused (0) unless `holder` holds the producer lease; the cursor only moves forward,
-- so rows re-read by a restarted producer never enqueue a request twice.
--! include now
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
