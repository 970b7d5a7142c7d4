-- Acks of many ranks in one call (a replica's streams, grouped): cursors only, no lease change.
-- KEYS: meta, acked.  ARGV: base, then (rank, step) pairs, steps >= 0.
-- Returns one reply per pair: '' (recorded) or the error code ACK would raise (ODB_RANK,
-- ODB_AHEAD); a pair's error does not stop the others (each pair is checked before it is written).
--! include trim
local m = redis.call('HMGET', KEYS[1], 'world_size', 'published_through')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local bound, through = tonumber(m[1]), tonumber(m[2])
local out, moved = {}, false
for i = 2, #ARGV, 2 do
  local rank, step = ARGV[i], tonumber(ARGV[i + 1])
  local r = tonumber(rank)
  if r < 0 or r >= bound then
    out[#out + 1] = 'ODB_RANK ' .. rank .. ' ' .. bound
  elseif step > through then
    out[#out + 1] = 'ODB_AHEAD ' .. step .. ' ' .. through
  else
    redis.call('ZADD', KEYS[2], 'GT', step, rank)
    out[#out + 1], moved = '', true
  end
end
if moved then trim() end
return out
