-- The world an ack or heartbeat is judged in (KEYS[1]: meta) and what refuses one entry apart
-- from its lease: a rank outside the world (the current one for an ack; for a heartbeat also
-- the draining ranks of the world it ended: ODB_RANK), and for an ack (step >= 0) a step not
-- published (ODB_AHEAD) or beyond the rank's delivery grant (KEYS[8]: ODB_UNSENT).
local m = redis.call('HMGET', KEYS[1], 'world_size', 'published_through', 'lease_ranks',
  'world_first')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local ws, through = tonumber(m[1]), tonumber(m[2])
local lr, first = tonumber(m[3] or m[1]), tonumber(m[4] or 0)

local function rank_refusal(rank, step)
  local r, bound = tonumber(rank), step >= 0 and ws or lr
  if r < 0 or r >= bound then return 'ODB_RANK ' .. rank .. ' ' .. bound end
  return nil
end

local function step_refusal(rank, step)
  if step < 0 then return nil end
  local granted = tonumber(redis.call('ZSCORE', KEYS[8], rank) or (first - 1))
  if step > through then return 'ODB_AHEAD ' .. step .. ' ' .. through end
  if step > granted then return 'ODB_UNSENT ' .. step .. ' ' .. granted end
  return nil
end
