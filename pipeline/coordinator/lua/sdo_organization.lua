-- SDO: the job's organization record (graph members, window, repeat gap), written once, fenced.
-- KEYS: meta, sdo. ARGV: generation, record. Returns 1 (written) or 0 (already identical).
--! include now
--! include fence
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local f = fenced(m[1], m[2], ARGV[1])
if f then return redis.error_reply(f) end
local old = redis.call('HGET', KEYS[2], 'organization')
if old then
  if old == ARGV[2] then return 0 end
  return redis.error_reply('ODB_SDO_CONFLICT organization')
end
redis.call('HSET', KEYS[2], 'organization', ARGV[2])
return 1
