-- KEYS: schema_version, jobs, meta
-- ARGV: schema_version, job_id, config_hash, seed
-- A `mode: refill` job in the registry (registry.register_refill_job): created with mode
-- 'refill' and no world (its consumers are counted in its refill:* keys), or resumed when the
-- config hash and mode match. Replies 1 created, 0 resumed; errors as REGISTER's.
--! include now
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return redis.error_reply('ODB_SCHEMA ' .. v) end
local m = redis.call('HMGET', KEYS[3], 'config_hash', 'mode')
if m[1] then
  if m[2] ~= 'refill' then return redis.error_reply('ODB_JOB mode ' .. m[2]) end
  if m[1] ~= ARGV[3] then return redis.error_reply('ODB_JOB config_hash ' .. m[1]) end
  return 0
end
if not v then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('HSET', KEYS[3], 'config_hash', ARGV[3], 'world_size', 0, 'mode', 'refill',
  'seed', ARGV[4], 'state', 'serving', 'published_through', -1, 'trimmed_through', -1,
  'created_ms', now)
redis.call('SADD', KEYS[2], ARGV[2])
return 1
