-- KEYS: schema_version, jobs, meta, acked
-- ARGV: schema_version, job_id, config_hash, world_size, mode, seed
--! include now
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return redis.error_reply('ODB_SCHEMA ' .. v) end
local m = redis.call('HMGET', KEYS[3], 'config_hash', 'world_size', 'mode', 'world_size0')
if m[1] then
  -- The specific differences first: the config hash covers them too. The world size to match
  -- is the registered one (a reconfiguration changes the current one, not the config).
  local w0 = m[4] or m[2]
  if w0 ~= ARGV[4] then return redis.error_reply('ODB_JOB world_size ' .. w0) end
  if m[3] ~= ARGV[5] then return redis.error_reply('ODB_JOB mode ' .. m[3]) end
  if m[1] ~= ARGV[3] then return redis.error_reply('ODB_JOB config_hash ' .. m[1]) end
  return 0
end
if not v then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('HSET', KEYS[3], 'config_hash', ARGV[3], 'world_size', ARGV[4], 'mode', ARGV[5],
  'seed', ARGV[6], 'state', 'planning', 'epoch', 0, 'published_through', -1,
  'trimmed_through', -1, 'trim_epoch', 0, 'trim_keep', 0, 'ckpt_epoch', -1, 'ckpt_rows', 0,
  'ckpt_next_step', 0, 'producer_gen', 0, 'producer_holder', '', 'producer_exp', 0,
  'created_ms', now, 'world_size0', ARGV[4], 'world_gen', 0, 'world_first', 0, 'adopting', 0,
  'lease_ranks', ARGV[4], 'trim_floor', -1)
-- Every rank starts at -1 so the minimum cursor (what trimming may drop) counts silent ranks.
local w = tonumber(ARGV[4])
local r = 0
while r < w do
  local args = {}
  local stop = math.min(w, r + 1000) - 1
  for k = r, stop do args[#args + 1] = -1; args[#args + 1] = k end
  redis.call('ZADD', KEYS[4], unpack(args))
  r = stop + 1
end
redis.call('SADD', KEYS[2], ARGV[2])
return 1
