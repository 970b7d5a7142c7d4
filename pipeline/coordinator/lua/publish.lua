-- One publication: steps + END records + checkpoint + counters + quarantine, all or nothing.
-- KEYS: meta, digests, ends, ckpt, counters, quarantine_ids, quarantine, world_times,
--       pending_ends
-- ARGV: base, fence, ckpt_epoch, ckpt_rows, ckpt_next_step, ckpt_blob, done, samples_in,
--       quarantine_cap, n_steps, ckpt_world, hold,
--       [epoch, step, header, samples, tokens, n_batches, (rank, blob)*]*,
--       n_ends, [epoch, blob]*, n_quarantined, [sample_id, reason, record]*
-- Returns {new_steps, planned_through}. The checkpoint's world must be the current one (a
-- producer that planned for a world a reconfiguration ended gets ODB_WORLD); the first
-- publication for a new world adopts it. A publication clears the producer's transient failure.
-- `hold` = '1' (fsync_publish): the steps, END records and `done` are written but not visible
-- (`planned_through` moves, `published_through` does not; ENDs wait in pending_ends) until
-- REVEAL, once WAITAOF confirmed them on disk. Otherwise they are visible at once (and so is
-- whatever an earlier held publication left pending).
--! include now
--! include fence
--! include reveal
local m = redis.call('HMGET', KEYS[1], 'published_through', 'state', 'ckpt_next_step', 'epoch',
  'producer_gen', 'producer_exp', 'ckpt_epoch', 'ckpt_rows', 'world_gen', 'world_size',
  'adopting', 'planned_through', 'pending_done')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local hold = ARGV[12] == '1'
local f = fenced(m[5], m[6], ARGV[2])
if f then return redis.error_reply(f) end
local wg, ws = tonumber(m[9] or 0), tonumber(m[10])
if tonumber(ARGV[11]) ~= wg then return redis.error_reply('ODB_WORLD ' .. ARGV[11] .. ' ' .. wg) end
local ce, cr = tonumber(ARGV[3]), tonumber(ARGV[4])
local oe, orows = tonumber(m[7]), tonumber(m[8])
if ce < oe or (ce == oe and cr < orows) then
  return redis.error_reply('ODB_CKPT backwards ' .. ce .. ':' .. cr .. ' ' .. oe .. ':' .. orows)
end
local retry = ce == oe and cr == orows
local expect = tonumber(m[12] or m[1]) + 1
local epoch = tonumber(m[4])
local i = 13
local new = {}
local pending = {}
for s = 1, tonumber(ARGV[10]) do
  local n, nb = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 5])
  local first, last = i + 6, i + 5 + 2 * nb
  local parts = {ARGV[i + 2]}
  for j = first, last, 2 do
    local r = tonumber(ARGV[j])
    if r < 0 or r >= ws then return redis.error_reply('ODB_RANK ' .. ARGV[j] .. ' ' .. ws) end
    parts[#parts + 1] = ARGV[j] .. '=' .. ARGV[j + 1]
  end
  local d = redis.sha1hex(table.concat(parts, '\n'))
  local old = pending[n] or redis.call('HGET', KEYS[2], n)
  if old then
    if old ~= d then return redis.error_reply('ODB_CONFLICT ' .. n) end
  elseif n == expect then
    new[#new + 1] = {n, d, i}
    pending[n] = d
    expect = n + 1
  else
    return redis.error_reply('ODB_GAP ' .. n .. ' ' .. expect)
  end
  i = last + 1
end
if #new > 0 and (m[2] == 'done' or m[13] == '1') then return redis.error_reply('ODB_DONE') end
local ne = tonumber(ARGV[i])
local ends = {}
local pending_ends = {}
i = i + 1
for s = 1, ne do
  local old = pending_ends[ARGV[i]] or redis.call('HGET', KEYS[3], ARGV[i])
    or redis.call('HGET', KEYS[9], ARGV[i])
  if old then
    if old ~= ARGV[i + 1] then return redis.error_reply('ODB_END_CONFLICT ' .. ARGV[i]) end
  else
    ends[#ends + 1] = i
    pending_ends[ARGV[i]] = ARGV[i + 1]
  end
  i = i + 2
end
local cn = tonumber(ARGV[5])
if cn < tonumber(m[3]) then return redis.error_reply('ODB_CKPT backwards ' .. cn .. ' ' .. m[3]) end
if cn > expect then return redis.error_reply('ODB_CKPT unpublished ' .. cn .. ' ' .. expect) end
-- All checks passed: write.
for _, p in ipairs(new) do
  local n, d, j = p[1], p[2], p[3]
  local e = tonumber(ARGV[j])
  local key = ARGV[1] .. 'step:' .. n
  redis.call('HSET', key, 'h', ARGV[j + 2])
  local k, stop = j + 6, j + 5 + 2 * tonumber(ARGV[j + 5])
  while k <= stop do
    local chunk = math.min(stop, k + 1999)
    redis.call('HSET', key, unpack(ARGV, k, chunk))
    k = chunk + 1
  end
  redis.call('HSET', KEYS[2], n, d)
  redis.call('HSETNX', KEYS[1], 'ef:' .. e, n)  -- the epoch's first step (trimming)
  redis.call('HINCRBY', KEYS[5], 'samples_planned', ARGV[j + 3])
  redis.call('HINCRBY', KEYS[5], 'tokens_planned', ARGV[j + 4])
  if e > epoch then epoch = e end
end
for _, j in ipairs(ends) do
  redis.call('HSET', KEYS[9], ARGV[j], ARGV[j + 1])  -- pending until revealed (below if not held)
  local e = tonumber(ARGV[j])
  if e > epoch then epoch = e end
end
if not retry then
  redis.call('HINCRBY', KEYS[5], 'samples_in', ARGV[8])
  local nq = tonumber(ARGV[i])
  i = i + 1
  local cap = tonumber(ARGV[9])
  for s = 1, nq do
    if redis.call('SADD', KEYS[6], ARGV[i]) == 1 then  -- a record is counted and listed once
      redis.call('HINCRBY', KEYS[5], 'quarantined:' .. ARGV[i + 1], 1)
      if redis.call('LLEN', KEYS[7]) < cap then redis.call('RPUSH', KEYS[7], ARGV[i + 2]) end
    end
    i = i + 3
  end
end
redis.call('HSET', KEYS[1], 'planned_through', expect - 1, 'epoch', epoch,
  'ckpt_next_step', cn, 'ckpt_epoch', ce, 'ckpt_rows', cr)
redis.call('SET', KEYS[4], ARGV[6])
redis.call('HDEL', KEYS[1], 'trouble', 'trouble_cause', 'trouble_ms', 'trouble_attempts')
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'pending_done', 1) end
if not hold then reveal(KEYS[1], KEYS[3], KEYS[9]) end
if m[11] == '1' then
  redis.call('HSET', KEYS[1], 'adopting', 0)
  redis.call('HSETNX', KEYS[8], wg .. ':adopted', now)
end
return {#new, expect - 1}
