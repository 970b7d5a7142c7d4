-- ARGV: base, holder, lease_ms.  The producer lease: 1 if `holder` holds it now (taken or renewed).
--! include now
local meta = ARGV[1] .. 'refill:meta'
local m = redis.call('HMGET', meta, 'producer', 'producer_exp')
if m[1] and m[1] ~= ARGV[2] and tonumber(m[2]) > now then return 0 end
redis.call('HSET', meta, 'producer', ARGV[2], 'producer_exp', now + tonumber(ARGV[3]))
return 1
