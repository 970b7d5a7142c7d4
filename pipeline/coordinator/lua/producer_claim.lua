-- The producer lease. KEYS: meta. ARGV: holder, lease_ms.
-- Returns the new generation, or {0, holder, expiry} while another holder's lease is live.
--! include now
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_holder', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
if m[2] ~= '' and m[2] ~= ARGV[1] and tonumber(m[3]) > now then return {0, m[2], m[3]} end
local gen = tonumber(m[1]) + 1
redis.call('HSET', KEYS[1], 'producer_gen', gen, 'producer_holder', ARGV[1],
  'producer_exp', now + tonumber(ARGV[2]))
return gen
