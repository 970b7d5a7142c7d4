-- A draining rank of an ended world got its END(reconfigure): release its lease (only its
-- holder's), stop counting it as draining, record when. KEYS: lease, lease_exp, draining,
-- world_times, meta. ARGV: generation (of the ended world), rank, client_id.
--! include now
local cur = redis.call('HGET', KEYS[1], ARGV[2])
if cur and string.sub(cur, string.find(cur, ':', 1, true) + 1) == ARGV[3] then
  redis.call('HDEL', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
end
local ng = tonumber(ARGV[1]) + 1
if tonumber(redis.call('HGET', KEYS[5], 'world_gen') or 0) == ng
    and redis.call('HGET', KEYS[3], ARGV[2]) == ARGV[3] then
  redis.call('HDEL', KEYS[3], ARGV[2])
end
redis.call('HSETNX', KEYS[4], ng .. ':left:' .. ARGV[2], now)
return 1
