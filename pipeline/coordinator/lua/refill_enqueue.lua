-- ARGV: base, holder, from_epoch, from_row, to_epoch, to_row, exhausted (0|1), n_requests,
--       n_quarantined, then n_requests quadruples (id, info, prompt ids, pixels or ''), then
--       n_quarantined JSON entries (each with its "reason").
-- One batch: the source rows from position (from_epoch, from_row) to (to_epoch, to_row) (the
-- next epoch's row 0 when the batch ends an epoch). Fenced: refused (0) unless `holder` holds
-- the producer lease. A batch applies only at the stored position, which it moves to its end
-- (1): rows re-read by a restarted producer never enqueue a request twice, and a retried call
-- (redis-py re-sends the EVALSHA after a timeout) finds the position at or past its end and
-- changes nothing (2). A batch from elsewhere (a stale position) is refused (0).
--! include now
local base = ARGV[1]
local meta = base .. 'refill:meta'
local m = redis.call('HMGET', meta, 'producer', 'producer_exp', 'epoch', 'cursor')
if m[1] ~= ARGV[2] or tonumber(m[2]) <= now then return 0 end
local pe, pr = tonumber(m[3] or '0'), tonumber(m[4] or '0')
local fe, fr = tonumber(ARGV[3]), tonumber(ARGV[4])
local te, tr = tonumber(ARGV[5]), tonumber(ARGV[6])
if fe ~= pe or fr ~= pr then
  if te < pe or (te == pe and tr <= pr) then return 2 end
  return 0
end
local cnt = base .. 'refill:counters'
local epoch = 'e' .. ARGV[3] .. ':'
local nr, nq = tonumber(ARGV[8]), tonumber(ARGV[9])
local added = 0
for i = 0, nr - 1 do
  local k = 10 + 4 * i
  local id, info = ARGV[k], ARGV[k + 1]
  if redis.call('HSETNX', base .. 'refill:info', id, info) == 1 then
    redis.call('HSET', base .. 'refill:req', id, ARGV[k + 2])
    if ARGV[k + 3] ~= '' then redis.call('HSET', base .. 'refill:pixels', id, ARGV[k + 3]) end
    redis.call('ZADD', base .. 'refill:wait', tonumber(string.match(info, '^%d+,(%d+)')), id)
    added = added + 1
  end
end
local q = base .. 'refill:quarantine'
for i = 0, nq - 1 do
  local entry = ARGV[10 + 4 * nr + i]
  if redis.call('LLEN', q) < 1000 then redis.call('RPUSH', q, entry) end
  redis.call('HINCRBY', cnt, 'reason:' .. cjson.decode(entry)['reason'], 1)
end
if added > 0 then
  redis.call('HINCRBY', cnt, 'enqueued', added)
  redis.call('HINCRBY', cnt, epoch .. 'enqueued', added)
end
if nq > 0 then
  redis.call('HINCRBY', cnt, 'quarantined', nq)
  redis.call('HINCRBY', cnt, epoch .. 'quarantined', nq)
end
redis.call('HSET', meta, 'epoch', te, 'cursor', tr, 'exhausted', ARGV[7])
return 1
