-- Delivery grants for many rank streams in one round trip (docs/elastic.md).
-- KEYS: meta, grants, worlds, world_times. ARGV: count, (generation, rank, through)*.
-- Returns per request {through, 0, 0} (current world: the grant, never past the plan), or
-- {last_step, 1, next_world_size} (an ended world: the rank's boundary), or {-1, -1, size}
-- (rank outside the world), or {-1, -2, current generation} (unknown world). A rank's first
-- grant of a step of its world is recorded (`<g>:first:<rank>`: the first batch's time).
--! include now
local m = redis.call('HMGET', KEYS[1], 'world_gen', 'world_size', 'world_first',
  'published_through')
if not m[4] then return redis.error_reply('ODB_NOJOB') end
local cur, ws, first, P = tonumber(m[1] or 0), tonumber(m[2]), tonumber(m[3] or 0),
  tonumber(m[4])
local recs = {}
local function rec(g)
  if not recs[g] then recs[g] = cjson.decode(redis.call('HGET', KEYS[3], g)) end
  return recs[g]
end
local out = {}
for i = 0, tonumber(ARGV[1]) - 1 do
  local g, r, want = tonumber(ARGV[2 + 3 * i]), tonumber(ARGV[3 + 3 * i]),
    tonumber(ARGV[4 + 3 * i])
  if g == cur then
    if r < 0 or r >= ws then out[#out + 1] = {-1, -1, ws}
    else
      local old = tonumber(redis.call('ZSCORE', KEYS[2], r) or (first - 1))
      local got = math.max(old, math.min(want, P))
      if got > old then redis.call('ZADD', KEYS[2], got, r) end
      if got >= first then redis.call('HSETNX', KEYS[4], cur .. ':first:' .. r, now) end
      out[#out + 1] = {got, 0, 0}
    end
  elseif g >= 0 and g < cur then
    local ls = rec(g)['l']
    if r < 0 or r >= #ls then out[#out + 1] = {-1, -1, #ls}
    else out[#out + 1] = {ls[r + 1], 1, rec(g + 1)['n']} end
  else
    out[#out + 1] = {-1, -2, cur}
  end
end
return out
