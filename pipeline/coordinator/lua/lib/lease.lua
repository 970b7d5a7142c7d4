-- Rank leases, shared by ACK and ACK_MANY. Their KEYS: [1] meta, [3] lease_exp, [4] lease,
-- [5] lapsed, [6] counters, [7] claimed; `now` from lib/now.
-- lease_check(rank, cid): the ODB_HELD error while another client's lease is live, else nil,
-- whether taking it takes over another client's lapsed lease, and whether cid holds it live.
local function lease_check(rank, cid)
  local cur = redis.call('HGET', KEYS[4], rank)
  if not cur then return nil, false, false end
  local holder = string.sub(cur, string.find(cur, ':', 1, true) + 1)
  local exp = tonumber(redis.call('ZSCORE', KEYS[3], rank))
  local live = exp ~= nil and exp > now
  if holder == cid then return nil, false, live end
  if live then return 'ODB_HELD ' .. exp .. ' ' .. now .. ' ' .. holder, false, false end
  return nil, exp ~= nil, false
end
-- lease_take(rank, cid, exp, took_over): the lease is cid's until exp (ms).
local function lease_take(rank, cid, exp, took_over)
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
