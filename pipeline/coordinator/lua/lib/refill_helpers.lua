-- Shared helpers: re-admit a consumer's leases (but `keep`), and every expired consumer's.
local base = ARGV[1]
local K_INFO, K_WAIT = base .. 'refill:info', base .. 'refill:wait'
local K_OWNER, K_CONS = base .. 'refill:owner', base .. 'refill:consumers'
local K_DONE, K_CNT = base .. 'refill:done', base .. 'refill:counters'
local EPOCH_ROWS = 4294967296  -- pipeline.refill.request.EPOCH_ROWS: seq = epoch * it + row
local function info_of(id)
  local s = redis.call('HGET', K_INFO, id)
  if not s then return nil end
  local cost, seq, over = string.match(s, '^(%d+),(%d+),(%d)')
  return tonumber(cost), tonumber(seq), over == '1'
end
local function epoch_of(seq)
  return string.format('%d', math.floor(seq / EPOCH_ROWS))
end
-- `refill:calls` holds each consumer's last ask as JSON
-- [call_seq, admitted, completed, stale, revoked].
-- `lapsed`: the consumer's lease lapsed (not a reopening): what it held goes to its
-- `refill:lost:<consumer>` set too (its next ask reports them revoked) and the lapse is counted.
local function release(consumer, keep, lapsed)
  local held = base .. 'refill:held:' .. consumer
  local n = 0
  for _, id in ipairs(redis.call('SMEMBERS', held)) do
    if not keep[id] then
      redis.call('SREM', held, id)
      redis.call('HDEL', K_OWNER, id)
      local _, seq = info_of(id)
      redis.call('ZADD', K_WAIT, seq, id)
      if lapsed then redis.call('SADD', base .. 'refill:lost:' .. consumer, id) end
      n = n + 1
    end
  end
  if n > 0 then
    redis.call('HINCRBY', K_CNT, 'readmitted', n)
    if lapsed then redis.call('HINCRBY', K_CNT, 'lease_lapses', 1) end
  end
  return n
end
-- An expired consumer's last reply stays on record: an ask it retries after a long outage
-- must get that reply again (its finished ids were recorded; applied afresh they would come
-- back neither completed nor stale). Its next ask or open replaces or drops it.
local function expire(t)
  for _, c in ipairs(redis.call('ZRANGEBYSCORE', K_CONS, '-inf', t)) do
    release(c, {}, true)
    redis.call('ZREM', K_CONS, c)
  end
end
