-- KEYS: lease, lease_exp, lease_claim. ARGV: rank, client_id, claim ('' = any). Only the
-- holder can release; with a claim, only while that is the rank's latest (no Open claimed the
-- rank since: a holder that did is alive).
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
if string.sub(cur, string.find(cur, ':', 1, true) + 1) ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
