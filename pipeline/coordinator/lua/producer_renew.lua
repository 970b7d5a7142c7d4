-- KEYS: meta. ARGV: generation, lease_ms (0 = release). Returns 1, or ODB_FENCED.
--! include now
local g = redis.call('HGET', KEYS[1], 'producer_gen')
if not g then return redis.error_reply('ODB_NOJOB') end
if g ~= ARGV[1] then return redis.error_reply('ODB_FENCED ' .. ARGV[1] .. ' ' .. g) end
local ms = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'producer_exp', ms > 0 and now + ms or 0)
return 1
