-- A member gives its seat up: its stream ended cleanly (RELEASE) or, with a generation, it got
-- END(reconfigure) from that ended world (LEFT). Python model: MemoryJobState.release_rank and
-- rank_left with a member. KEYS: meta, acked, lease_exp, lease, lapsed, counters, claimed,
-- grants, groups, members, member_exp, member_acked, draining, lease_claim, world_times.
-- ARGV: rank, member, group_size, client_id, generation (-1: a release), claim ('' = any).
-- Only the seat's holder releases it (with a claim: only while that is the seat's latest, as
-- RELEASE for a rank): the seat stops counting for the group's lease; once no seat is held the
-- group ends (the rank's lease goes) and, for a LEFT, the rank stops draining.
-- Returns 1 when the group ended, else 0.
--! include now
--! include group
local r, j, k, cid = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local gen = tonumber(ARGV[5])
local ended = false
local gk, absent = group_of(r)
if gk == k then
  local seat = seat_field(r, j)
  local cur = redis.call('HGET', KEYS[10], seat)
  local claim = ARGV[6]
  if cur and after_colon(cur) == cid
      and (claim == '' or redis.call('HGET', KEYS[14], seat) == claim) then
    redis.call('HSET', KEYS[10], seat, now .. ':')
    redis.call('HDEL', KEYS[11], seat)
    ended = not group_lease(r, k, absent)
  end
end
if gen >= 0 then
  local ng = gen + 1
  if ended and tonumber(redis.call('HGET', KEYS[1], 'world_gen') or 0) == ng
      and redis.call('HGET', KEYS[13], r) == 'group:' .. k then
    redis.call('HDEL', KEYS[13], r)
  end
  redis.call('HSETNX', KEYS[15], ng .. ':left:' .. r, now)
end
return ended and 1 or 0
