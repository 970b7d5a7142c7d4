-- KEYS: meta. ARGV: actor id, process (the actor's restart count). Returns 1 for the first
-- claim of that process's restart, 0 once it (or a later process of the actor) was claimed:
-- every replica supervises the producer, one restarts each stuck process.
local g = redis.call('HGET', KEYS[1], 'producer_gen')
if not g then return redis.error_reply('ODB_NOJOB') end
local n = tonumber(ARGV[2])
local last = redis.call('HMGET', KEYS[1], 'producer_restart_actor', 'producer_restart_n')
if last[1] == ARGV[1] and n <= tonumber(last[2]) then return 0 end
redis.call('HSET', KEYS[1], 'producer_restart_actor', ARGV[1], 'producer_restart_n', n)
return 1
