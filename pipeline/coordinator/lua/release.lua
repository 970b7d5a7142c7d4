-- KEYS: lease, lease_exp. ARGV: rank, client_id. Only the holder can release.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
if string.sub(cur, string.find(cur, ':', 1, true) + 1) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
