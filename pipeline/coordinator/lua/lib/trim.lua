-- Trimming (`trim()`, run by ACK and ACK_MANY after cursors moved) keeps the plan of the epoch
-- the slowest rank is in and of the one before it, so any step of the current epoch can be
-- replayed (a trainer restored from an old checkpoint): steps before the first step of epoch
-- (E - 1) go, E being the epoch of the slowest rank's next step.
-- Epochs without steps (quota mode can carry a whole epoch over) are skipped both ways: E is the
-- latest epoch with steps that started by that step, and "the one before" the latest epoch with
-- steps before E (the one the slowest rank finished last). `trim_keep` stores that epoch's first
-- step so trimming can catch up over several calls. It reads KEYS[1] meta, KEYS[2] acked and
-- ARGV[1] base.
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
  if floor >= 0 and keep > floor then keep = floor end  -- steps ranks of an ended world drain
  local tt = tonumber(m[1])
  if keep - 1 > tt then
    local upto = math.min(keep - 1, tt + 64)  -- at most 64 per call: amortized O(1)
    for n = tt + 1, upto do redis.call('UNLINK', ARGV[1] .. 'step:' .. n) end
    redis.call('HSET', KEYS[1], 'trimmed_through', upto)
  end
end
