-- ARGV: base, consumer, lease_ms, free_tokens, scan, call_seq, n_finished, finished ids...
-- Reply: {'ok', admitted ids (array), completed ids, stale ids, revoked ids} or
--        {'rejected', unknown ids, twice ids} (nothing applied) or
--        a retried call (same call_seq): the very reply of the first time, from the record.
-- `revoked`: ids taken from this consumer when its lease lapsed, which it neither reports
-- finished now nor gets back in this admission: it should stop them (pipeline.refill.leases).
--! include now
--! include refill_helpers
local consumer, lease = ARGV[2], tonumber(ARGV[3])
local free, scan, call = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local nf = tonumber(ARGV[7])
local prev = redis.call('HGET', base .. 'refill:calls', consumer)
if prev then
  local rec = cjson.decode(prev)
  if rec[1] == call then
    redis.call('ZADD', K_CONS, now + lease, consumer)
    return {'ok', rec[2], rec[3], rec[4], rec[5] or {}}
  end
end
local unknown, twice, seen = {}, {}, {}
for i = 8, 7 + nf do
  local id = ARGV[i]
  if redis.call('HEXISTS', K_INFO, id) == 0 then unknown[#unknown + 1] = id
  elseif seen[id] then twice[#twice + 1] = id end
  seen[id] = true
end
if #unknown > 0 or #twice > 0 then return {'rejected', unknown, twice} end
expire(now)
local K_LOST = base .. 'refill:lost:' .. consumer
local lost = redis.call('SMEMBERS', K_LOST)
redis.call('DEL', K_LOST)
local completed, stale = {}, {}
for i = 8, 7 + nf do
  local id = ARGV[i]
  local by = redis.call('HGET', K_DONE, id)
  local owner = redis.call('HGET', K_OWNER, id)
  if by then
    if by ~= consumer then stale[#stale + 1] = id end
  elseif owner and owner ~= consumer then
    stale[#stale + 1] = id
  else
    if owner then
      redis.call('HDEL', K_OWNER, id)
      redis.call('SREM', base .. 'refill:held:' .. owner, id)
    end
    redis.call('ZREM', K_WAIT, id)
    redis.call('HSET', K_DONE, id, consumer)
    local _, seq = info_of(id)
    redis.call('HINCRBY', K_CNT, 'e' .. epoch_of(seq) .. ':completed', 1)
    completed[#completed + 1] = id
  end
end
redis.call('ZADD', K_CONS, now + lease, consumer)
local held = base .. 'refill:held:' .. consumer
local idle = redis.call('SCARD', held) == 0
local admitted = {}
if free > 0 then
  local left = free
  for _, id in ipairs(redis.call('ZRANGE', K_WAIT, 0, scan - 1)) do
    if left <= 0 then break end
    local cost, _, over = info_of(id)
    if over then
      if idle and #admitted == 0 then admitted = {id}; break end
    elseif cost <= left then
      admitted[#admitted + 1] = id
      left = left - cost
    end
  end
  for _, id in ipairs(admitted) do
    redis.call('ZREM', K_WAIT, id)
    redis.call('HSET', K_OWNER, id, consumer)
    redis.call('SADD', held, id)
    seen[id] = true
  end
  if #admitted > 0 then redis.call('HINCRBY', K_CNT, 'admitted', #admitted) end
end
local revoked = {}
for _, id in ipairs(lost) do
  if not seen[id] then revoked[#revoked + 1] = id end
end
table.sort(revoked)
redis.call('HSET', base .. 'refill:calls', consumer,
  cjson.encode({call, admitted, completed, stale, revoked}))
return {'ok', admitted, completed, stale, revoked}
