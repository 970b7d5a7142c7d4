-- ARGV: base, consumer, lease_ms, retry_seq, held ids...
-- Re-admits the consumer's leases it no longer holds (a restarted consumer: all of them), renews
-- the rest. The admission of ask `retry_seq` (a retried ask whose reply was lost) is held too,
-- and stays on record for the retry; any other ask's record is dropped. Of the ids a lapse took
-- from it (`refill:lost:<consumer>`) only those it names as held are kept, to be reported
-- revoked by its next ask. Returns the number released.
--! include now
--! include refill_helpers
local consumer, lease, retry = ARGV[2], tonumber(ARGV[3]), ARGV[4]
expire(now)
local keep, named = {}, {}
for i = 5, #ARGV do keep[ARGV[i]] = true; named[ARGV[i]] = true end
local K_LOST = base .. 'refill:lost:' .. consumer
for _, id in ipairs(redis.call('SMEMBERS', K_LOST)) do
  if not named[id] then redis.call('SREM', K_LOST, id) end
end
local K_CALLS = base .. 'refill:calls'
local prev = redis.call('HGET', K_CALLS, consumer)
if prev then
  local rec = cjson.decode(prev)
  if rec[1] == retry then
    for _, id in ipairs(rec[2]) do keep[id] = true end
  else
    redis.call('HDEL', K_CALLS, consumer)
  end
end
local n = release(consumer, keep, false)
redis.call('ZADD', K_CONS, now + lease, consumer)
return n
