"""The Lua scripts (every multi-key change is one of these) and how they are called.

Scripts are loaded once per client and called by EVALSHA; after a Redis restart (scripts are not
persisted) the NOSCRIPT reply triggers one SCRIPT LOAD and a retry. Each script validates
everything before its first write, because a script that errors half-way is not rolled back.
Times come from the Redis clock (TIME), so leases mean the same to every server replica.
Errors are replies starting with a code (ODB_CONFLICT, ODB_HELD, ...) that the caller maps to
Python exceptions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

_NOW = "local _t = redis.call('TIME'); local now = _t[1] * 1000 + math.floor(_t[2] / 1000)\n"

# KEYS: schema_version, jobs, meta, acked
# ARGV: schema_version, job_id, config_hash, world_size, mode, seed, history_steps
REGISTER = _NOW + """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return redis.error_reply('ODB_SCHEMA ' .. v) end
local m = redis.call('HMGET', KEYS[3], 'config_hash', 'world_size', 'mode')
if m[1] then
  -- The specific differences first: the config hash covers them too.
  if m[2] ~= ARGV[4] then return redis.error_reply('ODB_JOB world_size ' .. m[2]) end
  if m[3] ~= ARGV[5] then return redis.error_reply('ODB_JOB mode ' .. m[3]) end
  if m[1] ~= ARGV[3] then return redis.error_reply('ODB_JOB config_hash ' .. m[1]) end
  -- history is an operator knob, not part of the plan: a restart may change it.
  redis.call('HSET', KEYS[3], 'history_steps', ARGV[7])
  return 0
end
if not v then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('HSET', KEYS[3], 'config_hash', ARGV[3], 'world_size', ARGV[4], 'mode', ARGV[5],
  'seed', ARGV[6], 'history_steps', ARGV[7], 'state', 'planning', 'epoch', 0,
  'published_through', -1, 'trimmed_through', -1, 'ckpt_next_step', 0, 'created_ms', now)
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

# KEYS: meta, digests, ends, ckpt
# ARGV: base, n_steps, [epoch, step, header, n_batches, (rank, blob)*]*, n_ends,
#       [epoch, blob]*, has_ckpt, ckpt_next_step, ckpt_blob
# Returns {new_steps, published_through}.
PUBLISH = """
local m = redis.call('HMGET', KEYS[1], 'published_through', 'state', 'ckpt_next_step', 'epoch')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
local expect = tonumber(m[1]) + 1
local epoch = tonumber(m[4])
local i = 3
local new = {}
local pending = {}
for s = 1, tonumber(ARGV[2]) do
  local e, n, nb = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 3])
  local first, last = i + 4, i + 3 + 2 * nb
  local parts = {ARGV[i + 2]}
  for j = first, last, 2 do parts[#parts + 1] = ARGV[j] .. '=' .. ARGV[j + 1] end
  local d = redis.sha1hex(table.concat(parts, '\\n'))
  local old = pending[n] or redis.call('HGET', KEYS[2], n)
  if old then
    if old ~= d then return redis.error_reply('ODB_CONFLICT ' .. n) end
  elseif n == expect then
    new[#new + 1] = {n, d, i, e}
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
i = i + 1
for s = 1, ne do
  local old = redis.call('HGET', KEYS[3], ARGV[i])
  if old then
    if old ~= ARGV[i + 1] then return redis.error_reply('ODB_END_CONFLICT ' .. ARGV[i]) end
  else
    ends[#ends + 1] = i
  end
  i = i + 2
end
local has_ckpt = ARGV[i] == '1'
if has_ckpt then
  local cn = tonumber(ARGV[i + 1])
  if cn < tonumber(m[3]) then
    return redis.error_reply('ODB_CKPT backwards ' .. cn .. ' ' .. m[3])
  end
  if cn > expect then return redis.error_reply('ODB_CKPT unpublished ' .. cn .. ' ' .. expect) end
end
-- All checks passed: write.
for _, p in ipairs(new) do
  local n, d, j, e = p[1], p[2], p[3], p[4]
  local key = ARGV[1] .. 'step:' .. n
  redis.call('HSET', key, 'h', ARGV[j + 2])
  local nb = tonumber(ARGV[j + 3])
  local k = j + 4
  local stop = j + 3 + 2 * nb
  while k <= stop do
    local chunk = math.min(stop, k + 1999)
    redis.call('HSET', key, unpack(ARGV, k, chunk))
    k = chunk + 1
  end
  redis.call('HSET', KEYS[2], n, d)
  if e > epoch then epoch = e end
end
for _, j in ipairs(ends) do
  redis.call('HSET', KEYS[3], ARGV[j], ARGV[j + 1])
  local e = tonumber(ARGV[j])
  if e > epoch then epoch = e end
end
redis.call('HSET', KEYS[1], 'published_through', expect - 1, 'epoch', epoch)
if has_ckpt then
  redis.call('SET', KEYS[4], ARGV[i + 2])
  redis.call('HSET', KEYS[1], 'ckpt_next_step', ARGV[i + 1])
end
return {#new, expect - 1}
"""

# Heartbeat (lease renew / claim) and ack in one round trip, plus amortized trimming.
# KEYS: meta, acked, lease_exp, lease, lapsed, counters
# ARGV: base, rank, client_id ('' = no lease change), lease_ms, step (< 0 = no ack),
#       soft ('1': another live holder is not an error, nothing changes, returns -2)
# Returns {lease_expiry_ms (-1 if no lease change, -2 if soft-refused), now_ms}.
ACK = _NOW + """
local rank, cid = ARGV[2], ARGV[3]
local step = tonumber(ARGV[5])
local took_over = false
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
local m
if step >= 0 then
  m = redis.call('HMGET', KEYS[1], 'published_through', 'trimmed_through', 'history_steps')
  if not m[1] then return redis.error_reply('ODB_NOJOB') end
  if step > tonumber(m[1]) then return redis.error_reply('ODB_AHEAD ' .. step .. ' ' .. m[1]) end
end
local exp = -1
if cid ~= '' then
  exp = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[4], rank, now .. ':' .. cid)
  redis.call('ZADD', KEYS[3], exp, rank)
  if took_over then  -- the previous holder's lease lapsed without release: keep it reported
    redis.call('SADD', KEYS[5], rank)
    redis.call('HINCRBY', KEYS[6], 'lease_lapses', 1)
  end
end
if step >= 0 then
  redis.call('ZADD', KEYS[2], 'GT', step, rank)
  -- Trim steps every rank acknowledged, beyond the retained history; at most 64 per call so
  -- no single ack runs long (the rest goes with the next acks): amortized O(1) per step.
  local lo = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local floor = tonumber(lo[2]) - tonumber(m[3])
  local tt = tonumber(m[2])
  if floor > tt then
    local upto = math.min(floor, tt + 64)
    for n = tt + 1, upto do redis.call('UNLINK', ARGV[1] .. 'step:' .. n) end
    redis.call('HSET', KEYS[1], 'trimmed_through', upto)
  end
end
return {exp, now}
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

# Leases expired at least ARGV[1] ms ago: O(log W + k) on the expiry zset.
# KEYS: lease_exp, lapsed. Returns {now_ms, {rank, expiry, ...}, {ranks taken over after a lapse}}.
LAPSED = _NOW + """
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[1])),
  'WITHSCORES')
return {now, rows, redis.call('SMEMBERS', KEYS[2])}
"""

# Every rank's cursor, lease expiry and last heartbeat, consistently at one instant: O(W).
# KEYS: acked, lease_exp, lease. Returns {now_ms, acked(flat), lease_exp(flat), lease(flat)}.
HEALTH = _NOW + """
return {now, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'),
  redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[3])}
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
publish = Script(PUBLISH)
ack = Script(ACK)
release = Script(RELEASE)
lapsed = Script(LAPSED)
health = Script(HEALTH)
ALL = (register, publish, ack, release, lapsed, health)
