-- Heartbeat (lease renew / claim) and ack in one round trip, plus amortized trimming.
-- KEYS: meta, acked, lease_exp, lease, lapsed, counters, claimed
-- ARGV: base, rank, client_id ('' = no lease change), lease_ms, step (< 0 = no ack),
--       soft ('1': another live holder is not an error, nothing changes, returns -2)
-- Returns {lease_expiry_ms (-1 if no lease change, -2 if soft-refused), now_ms}.
--! include now
--! include trim
local rank, cid = ARGV[2], ARGV[3]
local step = tonumber(ARGV[5])
local took_over = false
-- Cursors are the current world's ranks; leases also the draining ranks of the world it ended.
local wr = redis.call('HMGET', KEYS[1], 'world_size', 'lease_ranks')
if not wr[1] then return redis.error_reply('ODB_NOJOB') end
local r = tonumber(rank)
local bound = tonumber(step >= 0 and wr[1] or (wr[2] or wr[1]))
if r < 0 or r >= bound then return redis.error_reply('ODB_RANK ' .. rank .. ' ' .. bound) end
if cid ~= '' then
  local cur = redis.call('HGET', KEYS[4], rank)
  if cur then
    local holder = string.sub(cur, string.find(cur, ':', 1, true) + 1)
    if holder ~= cid then
      local exp = tonumber(redis.call('ZSCORE', KEYS[3], rank))
      if exp and exp > now then
        if ARGV[6] == '1' then return {-2, now} end  -- soft heartbeat: not ours, no error
        return redis.error_reply('ODB_HELD ' .. exp .. ' ' .. now .. ' ' .. holder)
      end
      took_over = exp ~= nil
    end
  end
end
if step >= 0 then
  local pt = redis.call('HGET', KEYS[1], 'published_through')
  if not pt then return redis.error_reply('ODB_NOJOB') end
  if step > tonumber(pt) then return redis.error_reply('ODB_AHEAD ' .. step .. ' ' .. pt) end
end
local exp = -1
if cid ~= '' then
  exp = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[4], rank, now .. ':' .. cid)
  redis.call('ZADD', KEYS[3], exp, rank)
  -- A rank that never claims is timed out from the job's first claim (Guarantee 4).
  redis.call('SADD', KEYS[7], rank)
  redis.call('HSETNX', KEYS[1], 'first_claim_ms', now)
  if took_over then  -- the previous holder's lease lapsed without release: keep it reported
    redis.call('SADD', KEYS[5], rank)
    redis.call('HINCRBY', KEYS[6], 'lease_lapses', 1)
  end
end
if step >= 0 then
  redis.call('ZADD', KEYS[2], 'GT', step, rank)
  trim()
end
return {exp, now}
