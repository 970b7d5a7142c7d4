-- Every rank's cursor, lease expiry and last heartbeat, consistently at one instant: O(W).
-- KEYS: acked, lease_exp, lease, meta.
-- Returns {now_ms, acked(flat), lease_exp(flat), lease(flat), current world size}.
--! include now
return {now, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'),
  redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[3]),
  redis.call('HGET', KEYS[4], 'world_size')}
