-- Model-parallel groups (docs/redis-schema.md); the model is pipeline/jobstate/groups.py, which
-- MemoryJobState keeps. KEYS of the scripts that include this: [1] meta, [2] acked,
-- [3] lease_exp, [4] lease, [5] lapsed, [6] counters, [7] claimed, [8] grants, [9] groups,
-- [10] members, [11] member_exp, [12] member_acked, [13] draining, [14] lease_claim (a seat's
-- claims so far: field "<r>:<j>"); `now` from lib/now.
-- A group of k seats of rank r: groups[r] = "<k>:<absent_until ms>" (a seat nobody took counts
-- as live until then); seat j is the field "<r>:<j>" of members ("<last sign ms>:<client>",
-- client '' = released, no field = never taken), member_exp (ms) and member_acked (its last
-- ack). The rank's lease names the group ("group:<k>") while the group is current; a record
-- left behind by a scale or a plain client's takeover is stale and ignored.
local function seat_field(r, j) return r .. ':' .. j end
local function after_colon(v) return string.sub(v, string.find(v, ':', 1, true) + 1) end
-- rank_holder(r): the rank lease's holder and expiry (nil, nil without one).
local function rank_holder(r)
  local cur = redis.call('HGET', KEYS[4], r)
  if not cur then return nil, nil end
  return after_colon(cur), tonumber(redis.call('ZSCORE', KEYS[3], r))
end
-- group_of(r): the current group's size and absent_until, or nil.
local function group_of(r)
  local g = redis.call('HGET', KEYS[9], r)
  local h = rank_holder(r)
  if not g or not h then return nil, nil end
  local sep = string.find(g, ':', 1, true)
  local k = tonumber(string.sub(g, 1, sep - 1))
  if h ~= 'group:' .. k then return nil, nil end
  return k, tonumber(string.sub(g, sep + 1))
end
-- seats(r, k): per seat (1-based) its client (nil: never taken, '' released), expiry, ack.
local function seats(r, k)
  local f = {}
  for j = 0, k - 1 do f[#f + 1] = seat_field(r, j) end
  local hs = redis.call('HMGET', KEYS[10], unpack(f))
  local es = redis.call('HMGET', KEYS[11], unpack(f))
  local as = redis.call('HMGET', KEYS[12], unpack(f))
  local out = {}
  for i = 1, k do
    out[i] = {hs[i] and after_colon(hs[i]) or nil, tonumber(es[i] or 0), tonumber(as[i] or -1)}
  end
  return out
end
-- live_seat(r, k): the first seat held live (its index, client), or nil.
local function live_seat(r, k)
  for i, s in ipairs(seats(r, k)) do
    if s[1] and s[1] ~= '' and s[2] > now then return i - 1, s[1] end
  end
  return nil, nil
end
local function drop_seats(r, k)
  local f = {}
  for j = 0, k - 1 do f[#f + 1] = seat_field(r, j) end
  redis.call('HDEL', KEYS[10], unpack(f))
  redis.call('HDEL', KEYS[11], unpack(f))
  redis.call('HDEL', KEYS[12], unpack(f))
end
-- group_lease(r, k, absent): the rank's lease becomes its group's (expiring with its first
-- seat: a held one at its expiry, one nobody took at `absent`; released ones do not count);
-- false when no seat is held any more: the group ends and the rank has no lease.
local function group_lease(r, k, absent)
  local exp, held = nil, false
  for _, s in ipairs(seats(r, k)) do
    local t = nil
    if s[1] == nil then t = absent elseif s[1] ~= '' then t, held = s[2], true end
    if t and (exp == nil or t < exp) then exp = t end
  end
  if not held then
    redis.call('HDEL', KEYS[4], r)
    redis.call('ZREM', KEYS[3], r)
    redis.call('HDEL', KEYS[9], r)
    drop_seats(r, k)
    return false
  end
  redis.call('HSET', KEYS[4], r, now .. ':group:' .. k)
  redis.call('ZADD', KEYS[3], exp, r)
  return true
end
-- member_check(r, j, k, cid): the error refusing the seat, else nil and whether a new group
-- forms, whether the seat is taken over from a lapsed client, whether cid holds it live.
-- A live holder of another group size (or alone) is refused (ODB_GROUP <its size> <a live
-- member, -1: alone> <its client>) unless it drains an ended world (ODB_HELD: wait for it).
local function member_check(r, j, k, cid)
  local h, exp = rank_holder(r)
  if not h then return nil, true, false, false end
  local gk = group_of(r)
  local drains = redis.call('HGET', KEYS[13], r) == h
  if not gk or gk ~= k then
    local lj, lc = -1, h
    if gk then lj, lc = live_seat(r, gk) end
    local live = (gk and lj ~= nil) or (not gk and exp ~= nil and exp > now)
    if not live then return nil, true, false, false end
    if drains then return 'ODB_HELD ' .. exp .. ' ' .. now .. ' ' .. h end
    return 'ODB_GROUP ' .. (gk or 1) .. ' ' .. lj .. ' ' .. lc
  end
  local s = seats(r, k)[j + 1]
  if s[1] and s[1] ~= '' and s[1] ~= cid then
    if s[2] > now then return 'ODB_MHELD ' .. s[2] .. ' ' .. now .. ' ' .. j .. ' ' .. s[1] end
    return nil, false, true, false
  end
  return nil, false, false, s[1] == cid and s[2] > now
end
