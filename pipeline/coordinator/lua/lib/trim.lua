-- Trimming (`trim()`, run by ACK and ACK_MANY after cursors moved) keeps the plan of the epoch
-- the slowest rank is in and of the one before it, so any step of the current epoch can be
-- replayed (a trainer restored from an old checkpoint): steps before the first step of epoch
-- (E - 1) go, E being the epoch of the slowest rank's next step.
-- Epochs without steps (quota mode can carry a whole epoch over) are skipped both ways: E is the
-- latest epoch with steps that started by that step, and "the one before" the latest epoch with
-- steps before E (the one the slowest rank finished last). `trim_keep` stores that epoch's first
-- step so trimming can catch up over several calls. After a reconfiguration `trim_floor` (set
-- by SCALE) keeps the steps the ended world's draining ranks may still read, while any of them
-- holds its lease; once none does (each got its END(reconfigure) or lost its lease), the floor
-- is dropped and trimming follows the new world's epochs again. It reads KEYS[1] meta,
-- KEYS[2] acked, KEYS[3] lease_exp, KEYS[4] lease, ARGV[1] base (`draining` from it) and `now`.
local function draining_live()  -- does a draining rank of the ended world hold its lease?
  local d = redis.call('HGETALL', ARGV[1] .. 'draining')
  for i = 1, #d, 2 do  -- (stops at the first live one: usually the first entry while draining)
    local cur = redis.call('HGET', KEYS[4], d[i])
    local exp = tonumber(redis.call('ZSCORE', KEYS[3], d[i]) or 0)
    if cur and string.sub(cur, string.find(cur, ':', 1, true) + 1) == d[i + 1]
        and exp > now then
      return true
    end
  end
  return false
end
local function trim()
  local m = redis.call('HMGET', KEYS[1], 'trimmed_through', 'trim_epoch', 'epoch', 'trim_keep',
    'trim_floor')
  local lo = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local need = tonumber(lo[2]) + 1
  local te, top = tonumber(m[2]), tonumber(m[3])
  local moved = false
  for e = te + 1, top do  -- usually one HGET: the next epoch has not started for that rank
    local f = redis.call('HGET', KEYS[1], 'ef:' .. e)
    if f then
      if tonumber(f) > need then break end
      te, moved = e, true
    end
  end
  local keep = tonumber(m[4] or 0)
  if moved then
    keep = 0
    for e = te - 1, 0, -1 do
      local f = redis.call('HGET', KEYS[1], 'ef:' .. e)
      if f then keep = tonumber(f) break end
    end
    redis.call('HSET', KEYS[1], 'trim_epoch', te, 'trim_keep', keep)
  end
  local floor = tonumber(m[5] or -1)
  if floor >= 0 and keep > floor then  -- steps ranks of an ended world may still drain
    if draining_live() then
      keep = floor
    else
      redis.call('HSET', KEYS[1], 'trim_floor', -1)  -- the old world is gone
    end
  end
  local tt = tonumber(m[1])
  if keep - 1 > tt then
    local upto = math.min(keep - 1, tt + 64)  -- at most 64 per call: amortized O(1)
    for n = tt + 1, upto do redis.call('UNLINK', ARGV[1] .. 'step:' .. n) end
    redis.call('HSET', KEYS[1], 'trimmed_through', upto)
  end
end
