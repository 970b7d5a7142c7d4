-- Leases expired at least ARGV[1] ms ago: O(log W + k) on the expiry zset; with ARGV[2] = '1'
-- also the ranks that ever claimed and the job's first claim (O(W): only the timeout check).
-- KEYS: lease_exp, lapsed, meta, claimed. Returns {now_ms, {rank, expiry, ...}, {ranks taken
-- over after a lapse}, current world size, {claimed ranks} or {}, first_claim_ms or false} (the
-- caller keeps the current world's ranks).
--! include now
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[1])),
  'WITHSCORES')
local ws = redis.call('HGET', KEYS[3], 'world_size')
if ARGV[2] ~= '1' then return {now, rows, redis.call('SMEMBERS', KEYS[2]), ws, {}, false} end
return {now, rows, redis.call('SMEMBERS', KEYS[2]), ws, redis.call('SMEMBERS', KEYS[4]),
  redis.call('HGET', KEYS[3], 'first_claim_ms')}
