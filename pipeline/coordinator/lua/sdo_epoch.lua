-- SDO: one epoch's visits and the exposure ledger after it, together, fenced; write-once per
-- epoch and in epoch order. KEYS: meta, sdo, sdo_visits.
-- ARGV: generation, epoch, visits, ledger_after, summary. Returns 1 (written) or 0 (identical).
--! include now
--! include fence
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local f = fenced(m[1], m[2], ARGV[1])
if f then return redis.error_reply(f) end
local old = redis.call('HGET', KEYS[3], ARGV[2])
if old then
  if old == ARGV[3] then return 0 end
  return redis.error_reply('ODB_SDO_CONFLICT epoch ' .. ARGV[2])
end
local nxt = tonumber(redis.call('HGET', KEYS[2], 'next_epoch') or '0')
if tonumber(ARGV[2]) ~= nxt then
  return redis.error_reply('ODB_SDO_ORDER ' .. ARGV[2] .. ' ' .. nxt)
end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], 'ledger', ARGV[4], 'summary', ARGV[5], 'next_epoch', nxt + 1)
return 1
