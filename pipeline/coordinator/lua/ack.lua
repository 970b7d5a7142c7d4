-- A rank's lease taken or renewed (CLAIM) and/or its cursor moved (ACK), plus amortized trimming.
-- KEYS: meta, acked, lease_exp, lease, lapsed, counters, claimed, lease_claim
-- ARGV: base, rank, client_id ('' = no lease change), lease_ms, step (< 0 = no ack)
-- Returns {lease_expiry_ms (-1 if no lease change), now_ms, the claim's number (0: none)}.
--! include now
--! include trim
--! include lease
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
  local held
  held, took_over = lease_check(rank, cid)
  if held then return redis.error_reply(held) end
end
if step >= 0 then
  local pt = redis.call('HGET', KEYS[1], 'published_through')
  if not pt then return redis.error_reply('ODB_NOJOB') end
  if step > tonumber(pt) then return redis.error_reply('ODB_AHEAD ' .. step .. ' ' .. pt) end
end
local exp, claim = -1, 0
if cid ~= '' then
  exp = now + tonumber(ARGV[4])
  lease_take(rank, cid, exp, took_over)
  claim = redis.call('HINCRBY', KEYS[8], rank, 1)
end
if step >= 0 then
  redis.call('ZADD', KEYS[2], 'GT', step, rank)
  trim()
end
return {exp, now, claim}
