"""The Lua scripts (every multi-key change is one of these) and how they are called.

Scripts are loaded once per client and called by EVALSHA; after a Redis restart (scripts are not
persisted) the NOSCRIPT reply triggers one SCRIPT LOAD and a retry. Each script validates
everything before its first write, because a script that errors half-way is not rolled back.
Times come from the Redis clock (TIME), so leases mean the same to every replica and producer.
Errors are replies starting with a code (ODB_CONFLICT, ODB_FENCED, ...) that the caller maps to
the exceptions of `pipeline.errors`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

_NOW = "local _t = redis.call('TIME'); local now = _t[1] * 1000 + math.floor(_t[2] / 1000)\n"

# KEYS: schema_version, jobs, meta, acked
# ARGV: schema_version, job_id, config_hash, world_size, mode, seed
REGISTER = _NOW + """
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
"""

# The producer lease. KEYS: meta. ARGV: holder, lease_ms.
# Returns the new generation, or {0, holder, expiry} while another holder's lease is live.
PRODUCER_CLAIM = _NOW + """
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_holder', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
if m[2] ~= '' and m[2] ~= ARGV[1] and tonumber(m[3]) > now then return {0, m[2], m[3]} end
local gen = tonumber(m[1]) + 1
redis.call('HSET', KEYS[1], 'producer_gen', gen, 'producer_holder', ARGV[1],
  'producer_exp', now + tonumber(ARGV[2]))
return gen
"""

# KEYS: meta. ARGV: generation, lease_ms (0 = release). Returns 1, or ODB_FENCED.
PRODUCER_RENEW = _NOW + """
local g = redis.call('HGET', KEYS[1], 'producer_gen')
if not g then return redis.error_reply('ODB_NOJOB') end
if g ~= ARGV[1] then return redis.error_reply('ODB_FENCED ' .. ARGV[1] .. ' ' .. g) end
local ms = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'producer_exp', ms > 0 and now + ms or 0)
return 1
"""

# The fence every producer write checks: the caller's generation is current and its lease live.
_FENCE = """
local function fenced(m_gen, m_exp, fence)
  if m_gen ~= fence then return 'ODB_FENCED ' .. fence .. ' ' .. m_gen end
  if tonumber(m_exp) <= now then return 'ODB_FENCED ' .. fence .. ' expired' end
  return nil
end
"""

# KEYS: meta. ARGV: generation, message.
SET_ERROR = _NOW + _FENCE + """
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local f = fenced(m[1], m[2], ARGV[1])
if f then return redis.error_reply(f) end
redis.call('HSET', KEYS[1], 'error', ARGV[2])
return 1
"""

# One publication: steps + END records + checkpoint + counters + quarantine, all or nothing.
# KEYS: meta, digests, ends, ckpt, counters, quarantine_ids, quarantine, world_times
# ARGV: base, fence, ckpt_epoch, ckpt_rows, ckpt_next_step, ckpt_blob, done, samples_in,
#       quarantine_cap,
#       n_steps, ckpt_world, [epoch, step, header, samples, tokens, n_batches, (rank, blob)*]*,
#       n_ends, [epoch, blob]*, n_quarantined, [sample_id, reason, record]*
# Returns {new_steps, published_through}. The checkpoint's world must be the current one (a
# producer that planned for a world a reconfiguration ended gets ODB_WORLD); the first
# publication for a new world adopts it.
PUBLISH = _NOW + _FENCE + """
local m = redis.call('HMGET', KEYS[1], 'published_through', 'state', 'ckpt_next_step', 'epoch',
  'producer_gen', 'producer_exp', 'ckpt_epoch', 'ckpt_rows', 'world_gen', 'world_size',
  'adopting')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
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
local expect = tonumber(m[1]) + 1
local epoch = tonumber(m[4])
local i = 12
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
  local d = redis.sha1hex(table.concat(parts, '\\n'))
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
if #new > 0 and m[2] == 'done' then return redis.error_reply('ODB_DONE') end
local ne = tonumber(ARGV[i])
local ends = {}
local pending_ends = {}
i = i + 1
for s = 1, ne do
  local old = pending_ends[ARGV[i]] or redis.call('HGET', KEYS[3], ARGV[i])
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
  redis.call('HSET', KEYS[3], ARGV[j], ARGV[j + 1])
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
redis.call('HSET', KEYS[1], 'published_through', expect - 1, 'epoch', epoch,
  'ckpt_next_step', cn, 'ckpt_epoch', ce, 'ckpt_rows', cr)
redis.call('SET', KEYS[4], ARGV[6])
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'state', 'done') end
if m[11] == '1' then
  redis.call('HSET', KEYS[1], 'adopting', 0)
  redis.call('HSETNX', KEYS[8], wg .. ':adopted', now)
end
return {#new, expect - 1}
"""

# Trimming (`trim()`, run by ACK and ACK_MANY after cursors moved) keeps the plan of the epoch
# the slowest rank is in and of the one before it, so any step of the current epoch can be
# replayed (a trainer restored from an old checkpoint): steps before the first step of epoch
# (E - 1) go, E being the epoch of the slowest rank's next step.
# Epochs without steps (quota mode can carry a whole epoch over) are skipped both ways: E is the
# latest epoch with steps that started by that step, and "the one before" the latest epoch with
# steps before E (the one the slowest rank finished last). `trim_keep` stores that epoch's first
# step so trimming can catch up over several calls. It reads KEYS[1] meta, KEYS[2] acked and
# ARGV[1] base.
_TRIM = """
local function trim()
  local m = redis.call('HMGET', KEYS[1], 'trimmed_through', 'trim_epoch', 'epoch', 'trim_keep',
    'trim_floor')
  local lo = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local need = tonumber(lo[2]) + 1
  local te, top = tonumber(m[2]), tonumber(m[3])
  local moved = false
  for e = te + 1, top do  -- usually one HGET: the next epoch has not started for that rank
    local f = redis.call('HGET', KEYS[1], 'ef:' .. e)
    if f then
      if tonumber(f) > need then break end
      te, moved = e, true
    end
  end
  local keep = tonumber(m[4] or 0)
  if moved then
    keep = 0
    for e = te - 1, 0, -1 do
      local f = redis.call('HGET', KEYS[1], 'ef:' .. e)
      if f then keep = tonumber(f) break end
    end
    redis.call('HSET', KEYS[1], 'trim_epoch', te, 'trim_keep', keep)
  end
  local floor = tonumber(m[5] or -1)
  if floor >= 0 and keep > floor then keep = floor end  -- steps ranks of an ended world drain
  local tt = tonumber(m[1])
  if keep - 1 > tt then
    local upto = math.min(keep - 1, tt + 64)  -- at most 64 per call: amortized O(1)
    for n = tt + 1, upto do redis.call('UNLINK', ARGV[1] .. 'step:' .. n) end
    redis.call('HSET', KEYS[1], 'trimmed_through', upto)
  end
end
"""
# Heartbeat (lease renew / claim) and ack in one round trip, plus amortized trimming.
# KEYS: meta, acked, lease_exp, lease, lapsed, counters, claimed
# ARGV: base, rank, client_id ('' = no lease change), lease_ms, step (< 0 = no ack),
#       soft ('1': another live holder is not an error, nothing changes, returns -2)
# Returns {lease_expiry_ms (-1 if no lease change, -2 if soft-refused), now_ms}.
ACK = _NOW + _TRIM + """
local rank, cid = ARGV[2], ARGV[3]
local step = tonumber(ARGV[5])
local took_over = false
-- Cursors are the current world's ranks; leases also the draining ranks of the world it ended.
local wr = redis.call('HMGET', KEYS[1], 'world_size', 'lease_ranks')
if not wr[1] then return redis.error_reply('ODB_NOJOB') end
local r = tonumber(rank)
local bound = tonumber(step >= 0 and wr[1] or (wr[2] or wr[1]))
if r < 0 or r >= bound then return redis.error_reply('ODB_RANK ' .. rank .. ' ' .. bound) end
if cid ~= '' then
  local cur = redis.call('HGET', KEYS[4], rank)
  if cur then
    local holder = string.sub(cur, string.find(cur, ':', 1, true) + 1)
    if holder ~= cid then
      local exp = tonumber(redis.call('ZSCORE', KEYS[3], rank))
      if exp and exp > now then
        if ARGV[6] == '1' then return {-2, now} end  -- soft heartbeat: not ours, no error
        return redis.error_reply('ODB_HELD ' .. exp .. ' ' .. now .. ' ' .. holder)
      end
      took_over = exp ~= nil
    end
  end
end
if step >= 0 then
  local pt = redis.call('HGET', KEYS[1], 'published_through')
  if not pt then return redis.error_reply('ODB_NOJOB') end
  if step > tonumber(pt) then return redis.error_reply('ODB_AHEAD ' .. step .. ' ' .. pt) end
end
local exp = -1
if cid ~= '' then
  exp = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[4], rank, now .. ':' .. cid)
  redis.call('ZADD', KEYS[3], exp, rank)
  -- A rank that never claims is timed out from the job's first claim (Guarantee 4).
  redis.call('SADD', KEYS[7], rank)
  redis.call('HSETNX', KEYS[1], 'first_claim_ms', now)
  if took_over then  -- the previous holder's lease lapsed without release: keep it reported
    redis.call('SADD', KEYS[5], rank)
    redis.call('HINCRBY', KEYS[6], 'lease_lapses', 1)
  end
end
if step >= 0 then
  redis.call('ZADD', KEYS[2], 'GT', step, rank)
  trim()
end
return {exp, now}
"""

# Acks of many ranks in one call (a replica's streams, grouped): cursors only, no lease change.
# KEYS: meta, acked.  ARGV: base, then (rank, step) pairs, steps >= 0.
# Returns one reply per pair: '' (recorded) or the error code ACK would raise (ODB_RANK,
# ODB_AHEAD); a pair's error does not stop the others (each pair is checked before it is written).
ACK_MANY = _TRIM + """
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
"""

# KEYS: lease, lease_exp. ARGV: rank, client_id. Only the holder can release.
RELEASE = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
if string.sub(cur, string.find(cur, ':', 1, true) + 1) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# Leases expired at least ARGV[1] ms ago: O(log W + k) on the expiry zset; with ARGV[2] = '1'
# also the ranks that ever claimed and the job's first claim (O(W): only the timeout check).
# KEYS: lease_exp, lapsed, meta, claimed. Returns {now_ms, {rank, expiry, ...}, {ranks taken
# over after a lapse}, current world size, {claimed ranks} or {}, first_claim_ms or false} (the
# caller keeps the current world's ranks).
LAPSED = _NOW + """
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[1])),
  'WITHSCORES')
local ws = redis.call('HGET', KEYS[3], 'world_size')
if ARGV[2] ~= '1' then return {now, rows, redis.call('SMEMBERS', KEYS[2]), ws, {}, false} end
return {now, rows, redis.call('SMEMBERS', KEYS[2]), ws, redis.call('SMEMBERS', KEYS[4]),
  redis.call('HGET', KEYS[3], 'first_claim_ms')}
"""

# Every rank's cursor, lease expiry and last heartbeat, consistently at one instant: O(W).
# KEYS: acked, lease_exp, lease, meta.
# Returns {now_ms, acked(flat), lease_exp(flat), lease(flat), current world size}.
HEALTH = _NOW + """
return {now, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'),
  redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[3]),
  redis.call('HGET', KEYS[4], 'world_size')}
"""

# A reconfiguration (docs/elastic.md): end the current world at a boundary and start the next.
# KEYS: meta, acked, lease_exp, lease, grants, draining, worlds, world_times, ends, counters,
#       lapsed, claimed
# ARGV: base, world_size, reason, position (-1: none), require_gone ('1'|'0'),
#       expect_generation (-1: any)
# Each rank's last step is `choose_boundary` (pipeline/jobstate/worlds.py), mirrored here: with a
# position every rank ends at position - 1; otherwise live ranks (a live lease) end at the
# highest grant among them, never before the last step of an epoch whose END is published, and
# the others at what they acknowledged. Returned batches (after a rank's last step, up to the
# published plan) leave the planned counters; cursors move to the new world's first step - 1,
# grants are cleared, live ranks are recorded as draining (their client) and protect their
# steps from trimming (`trim_floor`); the leases of the gone ranks, the lapse history and the
# claimed set are dropped (they are not the new world's ranks, which reuse the ids and time out
# from the new world's first claim). Returns {0, gen} for no
# change, else {1, ended world record, new world record}.
SCALE = _NOW + """
local m = redis.call('HMGET', KEYS[1], 'published_through', 'state', 'world_gen', 'world_size',
  'world_first', 'adopting', 'created_ms')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local P, gen, w, first = tonumber(m[1]), tonumber(m[3] or 0), tonumber(m[4]), tonumber(m[5] or 0)
local n, expect = tonumber(ARGV[2]), tonumber(ARGV[6])
if (expect >= 0 and expect ~= gen) or n == w then return {0, gen} end
if m[2] == 'done' then return redis.error_reply('ODB_PLANNED ' .. w) end
if m[6] == '1' then return redis.error_reply('ODB_SCALING adopting ' .. gen .. ' ' .. w) end
local function holder(r)  -- the client of rank r's lease and its expiry, or nil
  local cur = redis.call('HGET', KEYS[4], r)
  if not cur then return nil, nil end
  return string.sub(cur, string.find(cur, ':', 1, true) + 1),
    tonumber(redis.call('ZSCORE', KEYS[3], r))
end
local busy = {}
local d = redis.call('HGETALL', KEYS[6])
for i = 1, #d, 2 do
  local cid, exp = holder(d[i])
  if cid == d[i + 1] and exp and exp > now then busy[#busy + 1] = d[i] end
end
if #busy > 0 then return redis.error_reply('ODB_SCALING draining ' .. table.concat(busy, ',')) end
local live, clients, live_list = {}, {}, {}
for r = 0, w - 1 do
  local cid, exp = holder(r)
  live[r] = cid ~= nil and exp ~= nil and exp > now
  if live[r] then clients[r] = cid; live_list[#live_list + 1] = r end
end
if ARGV[5] == '1' and #live_list > 0 then
  return redis.error_reply('ODB_LIVE ' .. w .. ' ' .. table.concat(live_list, ','))
end
local floor = first - 1
local function clamp(x) return math.min(math.max(x, floor), P) end
local lastend = -1
for _, blob in ipairs(redis.call('HVALS', KEYS[9])) do
  for _, s in ipairs(cjson.decode(blob)['f']) do
    if s ~= cjson.null and s > lastend then lastend = s end
  end
end
local L = {}
local pos = tonumber(ARGV[4])
if pos >= 0 then
  for r = 0, w - 1 do L[r] = clamp(pos - 1) end
else
  local b = math.max(lastend, floor)
  for r = 0, w - 1 do
    if live[r] then
      local g = tonumber(redis.call('ZSCORE', KEYS[5], r) or floor)
      if g > b then b = g end
    end
  end
  b = clamp(b)
  for r = 0, w - 1 do
    if live[r] then L[r] = b
    else L[r] = clamp(tonumber(redis.call('ZSCORE', KEYS[2], r) or -1)) end
  end
end
local rs, rt = 0, 0
for r = 0, w - 1 do
  for k = L[r] + 1, P do
    local blob = redis.call('HGET', ARGV[1] .. 'step:' .. k, r)
    if blob then
      local b = cjson.decode(blob)
      if not b['f'] then
        local cut = {}
        if b['t'] then for _, t in ipairs(b['t']) do cut[tostring(t[1])] = t[2] end end
        for _, smp in ipairs(b['s']) do
          rs = rs + 1
          rt = rt + (cut[tostring(smp[1])] or smp[2])
        end
      end
    end
  end
end
-- All checks passed: write.
local Ls = {}
for r = 0, w - 1 do Ls[#Ls + 1] = L[r] end
local rec = redis.call('HGET', KEYS[7], gen)
local old = rec and string.sub(rec, 1, -2) or ('{"g":' .. gen .. ',"n":' .. w .. ',"f":' ..
  first .. ',"r":"initial","t":' .. (m[7] or 0))
old = old .. ',"l":[' .. table.concat(Ls, ',') .. '],"p":' .. P .. ',"v":[' ..
  table.concat(live_list, ',') .. '],"rs":' .. rs .. ',"rt":' .. rt .. '}'
local ng = gen + 1
local new = '{"g":' .. ng .. ',"n":' .. n .. ',"f":' .. (P + 1) .. ',"r":"' .. ARGV[3] ..
  '","t":' .. now .. '}'
redis.call('HSET', KEYS[7], gen, old, ng, new)
local tf = P + 1
for _, r in ipairs(live_list) do
  local a = tonumber(redis.call('ZSCORE', KEYS[2], r) or -1) + 1
  if a < tf then tf = a end
end
redis.call('HSET', KEYS[1], 'world_gen', ng, 'world_size', n, 'world_first', P + 1, 'adopting', 1,
  'lease_ranks', math.max(n, w), 'trim_floor', tf)
redis.call('DEL', KEYS[2], KEYS[5], KEYS[6])
local r = 0
while r < n do
  local args = {}
  local stop = math.min(n, r + 1000) - 1
  for k = r, stop do args[#args + 1] = P; args[#args + 1] = k end
  redis.call('ZADD', KEYS[2], unpack(args))
  r = stop + 1
end
for _, lr in ipairs(live_list) do redis.call('HSET', KEYS[6], lr, clients[lr]) end
for g = 0, w - 1 do
  if not live[g] then
    redis.call('HDEL', KEYS[4], g)
    redis.call('ZREM', KEYS[3], g)
  end
end
redis.call('DEL', KEYS[11], KEYS[12])  -- the new world's ranks claim (and time out) anew
redis.call('HDEL', KEYS[1], 'first_claim_ms')
redis.call('HINCRBY', KEYS[10], 'samples_planned', 0 - rs)  -- (-0 would print as "-0")
redis.call('HINCRBY', KEYS[10], 'tokens_planned', 0 - rt)
redis.call('HSET', KEYS[8], ng .. ':requested', now)
return {1, old, new}
"""

# Delivery grants for many rank streams in one round trip (docs/elastic.md).
# KEYS: meta, grants, worlds, world_times. ARGV: count, (generation, rank, through)*.
# Returns per request {through, 0, 0} (current world: the grant, never past the plan), or
# {last_step, 1, next_world_size} (an ended world: the rank's boundary), or {-1, -1, size}
# (rank outside the world), or {-1, -2, current generation} (unknown world). A rank's first
# grant of a step of its world is recorded (`<g>:first:<rank>`: the first batch's time).
GRANT = _NOW + """
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
"""

# A draining rank of an ended world got its END(reconfigure): release its lease (only its
# holder's), stop counting it as draining, record when. KEYS: lease, lease_exp, draining,
# world_times, meta. ARGV: generation (of the ended world), rank, client_id.
LEFT = _NOW + """
local cur = redis.call('HGET', KEYS[1], ARGV[2])
if cur and string.sub(cur, string.find(cur, ':', 1, true) + 1) == ARGV[3] then
  redis.call('HDEL', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
end
local ng = tonumber(ARGV[1]) + 1
if tonumber(redis.call('HGET', KEYS[5], 'world_gen') or 0) == ng
    and redis.call('HGET', KEYS[3], ARGV[2]) == ARGV[3] then
  redis.call('HDEL', KEYS[3], ARGV[2])
end
redis.call('HSETNX', KEYS[4], ng .. ':left:' .. ARGV[2], now)
return 1
"""


# SDO: the job's organization record (graph members, window, repeat gap), written once, fenced.
# KEYS: meta, sdo. ARGV: generation, record. Returns 1 (written) or 0 (already identical).
SDO_ORGANIZATION = _NOW + _FENCE + """
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local f = fenced(m[1], m[2], ARGV[1])
if f then return redis.error_reply(f) end
local old = redis.call('HGET', KEYS[2], 'organization')
if old then
  if old == ARGV[2] then return 0 end
  return redis.error_reply('ODB_SDO_CONFLICT organization')
end
redis.call('HSET', KEYS[2], 'organization', ARGV[2])
return 1
"""

# SDO: one epoch's visits and the exposure ledger after it, together, fenced; write-once per
# epoch and in epoch order. KEYS: meta, sdo, sdo_visits.
# ARGV: generation, epoch, visits, ledger_after, summary. Returns 1 (written) or 0 (identical).
SDO_EPOCH = _NOW + _FENCE + """
local m = redis.call('HMGET', KEYS[1], 'producer_gen', 'producer_exp')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local f = fenced(m[1], m[2], ARGV[1])
if f then return redis.error_reply(f) end
local old = redis.call('HGET', KEYS[3], ARGV[2])
if old then
  if old == ARGV[3] then return 0 end
  return redis.error_reply('ODB_SDO_CONFLICT epoch ' .. ARGV[2])
end
local nxt = tonumber(redis.call('HGET', KEYS[2], 'next_epoch') or '0')
if tonumber(ARGV[2]) ~= nxt then
  return redis.error_reply('ODB_SDO_ORDER ' .. ARGV[2] .. ' ' .. nxt)
end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], 'ledger', ARGV[4], 'summary', ARGV[5], 'next_epoch', nxt + 1)
return 1
"""

class Script:
    """One Lua source with its SHA1; `__call__` is one EVALSHA (plus a reload after NOSCRIPT)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            # Redis restarted or SCRIPT FLUSH: load once and retry (every script is idempotent
            # or validated, so a retry cannot apply a change twice differently).
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)


register = Script(REGISTER)
producer_claim = Script(PRODUCER_CLAIM)
producer_renew = Script(PRODUCER_RENEW)
set_error = Script(SET_ERROR)
publish = Script(PUBLISH)
ack = Script(ACK)
ack_many = Script(ACK_MANY)
release = Script(RELEASE)
lapsed = Script(LAPSED)
health = Script(HEALTH)
sdo_organization = Script(SDO_ORGANIZATION)
sdo_epoch = Script(SDO_EPOCH)
scale = Script(SCALE)
grant = Script(GRANT)
left = Script(LEFT)
