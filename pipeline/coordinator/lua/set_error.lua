-- A producer failure, fenced like a publish. KEYS: meta.
-- ARGV: generation, message, cause (default 'internal'), transient ('1': trouble the producer
-- retries; else the job's permanent error). A transient one keeps its streak's first time and
-- counts the attempts (a publication clears it); a permanent one replaces it.
--! include now
--! include fence
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local f = fenced(m[1], m[2], ARGV[1])
if f then return redis.error_reply(f) end
local cause = ARGV[3] or 'internal'
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'trouble', ARGV[2], 'trouble_cause', cause)
  redis.call('HSETNX', KEYS[1], 'trouble_ms', now)
  redis.call('HINCRBY', KEYS[1], 'trouble_attempts', 1)
else
  redis.call('HSET', KEYS[1], 'error', ARGV[2], 'error_cause', cause, 'error_ms', now)
  redis.call('HDEL', KEYS[1], 'trouble', 'trouble_cause', 'trouble_ms', 'trouble_attempts')
end
return 1
