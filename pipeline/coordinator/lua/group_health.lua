-- Every group's seats and the rank leases that say which groups are current, at one instant:
-- O(seats). KEYS: meta, lease, groups, members, member_exp, member_acked.
-- Returns {now_ms, world size, lease(flat), groups(flat), members(flat), member_exp(flat),
-- member_acked(flat)}.
--! include now
return {now, redis.call('HGET', KEYS[1], 'world_size'), redis.call('HGETALL', KEYS[2]),
  redis.call('HGETALL', KEYS[3]), redis.call('HGETALL', KEYS[4]), redis.call('HGETALL', KEYS[5]),
  redis.call('HGETALL', KEYS[6])}
