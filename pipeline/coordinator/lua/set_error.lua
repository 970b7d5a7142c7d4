-- KEYS: meta. ARGV: generation, message.
--! include now
--! include fence
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local f = fenced(m[1], m[2], ARGV[1])
if f then return redis.error_reply(f) end
redis.call('HSET', KEYS[1], 'error', ARGV[2])
return 1
