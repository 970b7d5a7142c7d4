-- Members' claims, acks and heartbeats (a replica's streams of grouped ranks, grouped into one
-- call; the plain ranks' go to ACK_MANY). Python model: MemoryJobState.ack_many with members.
-- KEYS: meta, acked, lease_exp, lease, lapsed, counters, claimed, grants, groups, members,
--       member_exp, member_acked, draining, lease_claim
-- ARGV: base, lease_ms, then (rank, member, group_size, client_id, step, renew, claim)
-- septuples; step < 0: a claim or heartbeat (no cursor); renew '0': the seat is renewed only if
-- its client does not hold it live; claim '1': a seat's Open (its claims are counted per seat,
-- as ACK counts a rank's). Each is checked before anything of it is written: the rank inside the world
-- (ODB_RANK, as ACK_MANY), the seat (lib/group member_check: ODB_GROUP, ODB_HELD, ODB_MHELD),
-- for an ack the step published (ODB_AHEAD) and within the rank's grant (ODB_UNSENT). Then a
-- new group forms where none is current (its seats' acks start at the rank's cursor; taking a
-- lapsed lease over counts a lapse), the seat is the client's for lease_ms more (a lapse counted
-- when another client's lapsed seat is taken), its ack moves (monotonic) and the rank's cursor
-- moves to the lowest of the group's seats; the rank's lease becomes the group's.
-- Returns one reply per entry: {the seat's expiry (ms), the claim's number (0: not a claim)} or
-- its error.
--! include now
--! include trim
--! include group
--! include ack_bounds
local lease_ms = tonumber(ARGV[2])
local out, moved = {}, false
for i = 3, #ARGV, 7 do
  local rank, j, k, cid = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3]
  local step = tonumber(ARGV[i + 4])
  local err, form, took_over, held = rank_refusal(rank, step), false, false, false
  if not err then err, form, took_over, held = member_check(rank, j, k, cid) end
  if not err then err = step_refusal(rank, step) end
  if err then
    out[#out + 1] = err
  else
    local seat = seat_field(rank, j)
    if form then
      if redis.call('HEXISTS', KEYS[4], rank) == 1 then  -- an earlier lease lapsed: taken over
        redis.call('SADD', KEYS[5], rank)
        redis.call('HINCRBY', KEYS[6], 'lease_lapses', 1)
      end
      local old = redis.call('HGET', KEYS[9], rank)
      if old then
        drop_seats(rank, tonumber(string.sub(old, 1, string.find(old, ':', 1, true) - 1)))
      end
      redis.call('HSET', KEYS[9], rank, k .. ':' .. (now + lease_ms))
      local cursor = tonumber(redis.call('ZSCORE', KEYS[2], rank) or -1)
      local acks = {}
      for s = 0, k - 1 do acks[#acks + 1] = seat_field(rank, s); acks[#acks + 1] = cursor end
      redis.call('HSET', KEYS[12], unpack(acks))
      redis.call('SADD', KEYS[7], rank)
      redis.call('HSETNX', KEYS[1], 'first_claim_ms', now)
    end
    redis.call('HSET', KEYS[10], seat, now .. ':' .. cid)
    if form or ARGV[i + 5] == '1' or not held then
      if took_over then
        redis.call('SADD', KEYS[5], rank)
        redis.call('HINCRBY', KEYS[6], 'lease_lapses', 1)
      end
      redis.call('HSET', KEYS[11], seat, now + lease_ms)
    end
    if step >= 0 then
      if step > tonumber(redis.call('HGET', KEYS[12], seat)) then
        redis.call('HSET', KEYS[12], seat, step)
      end
      local low = nil
      for _, s in ipairs(seats(rank, k)) do
        if low == nil or s[3] < low then low = s[3] end
      end
      redis.call('ZADD', KEYS[2], 'GT', low, rank)
      moved = true
    end
    local g = redis.call('HGET', KEYS[9], rank)
    group_lease(rank, k, tonumber(string.sub(g, string.find(g, ':', 1, true) + 1)))
    local claim = 0
    if ARGV[i + 6] == '1' then claim = redis.call('HINCRBY', KEYS[14], seat, 1) end
    out[#out + 1] = {tonumber(redis.call('HGET', KEYS[11], seat)), claim}
  end
end
if moved then trim() end
return out
