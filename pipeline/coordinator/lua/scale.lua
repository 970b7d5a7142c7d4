-- A reconfiguration (docs/elastic.md): end the current world at a boundary and start the next.
-- KEYS: meta, acked, lease_exp, lease, grants, draining, worlds, world_times, ends, counters,
--       lapsed, claimed, pending_ends
-- ARGV: base, world_size, reason, position (-1: none), require_gone ('1'|'0'),
--       expect_generation (-1: any)
-- Each rank's last step is `choose_boundary` (pipeline/jobstate/worlds.py), mirrored here: with a
-- position every rank ends at position - 1; otherwise live ranks (a live lease) end at the
-- highest grant among them, and the others at what they acknowledged; never (the position, the
-- live ranks) before the last step of an epoch whose END is published. Returned batches (after
-- a rank's last step, up to the plan's end, held steps of fsync_publish included) leave the planned counters; cursors move to
-- the new world's first step - 1, grants are cleared, live ranks are recorded as draining (their
-- client) and protect their steps from trimming (`trim_floor`); the leases of the gone ranks, the
-- lapse history and the claimed set are dropped (they are not the new world's ranks, which reuse
-- the ids and time out from the new world's first claim).
-- A fully planned job (`done`, or a held done): when no live rank may have its final END (each
-- was granted less than its last step of that epoch), that END is not a bound: it is voided and
-- the job reopened (`state` planning) for the producer to re-plan the epoch's rest in the new
-- world; otherwise, if any batch would return, ODB_PLANNED (the ranks that may have the END);
-- if none would, the switch has nothing to plan (adopted at once).
-- Returns {0, gen} for no change, else {1, ended world record, new world record}.
--! include now
local m = redis.call('HMGET', KEYS[1], 'published_through', 'state', 'world_gen', 'world_size',
  'world_first', 'adopting', 'created_ms', 'planned_through', 'pending_done')
if not m[1] then return redis.error_reply('ODB_NOJOB') end
-- P: the plan's end, visible or held (fsync_publish): a held step is the old world's too.
local P, gen, w, first = tonumber(m[8] or m[1]), tonumber(m[3] or 0), tonumber(m[4]),
  tonumber(m[5] or 0)
local n, expect = tonumber(ARGV[2]), tonumber(ARGV[6])
if (expect >= 0 and expect ~= gen) or n == w then return {0, gen} end
local done = m[2] == 'done' or m[9] == '1'
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
-- Every END (held ones of fsync_publish too): the last step of each; the final one of a job.
local endsteps, final_epoch, final = {}, -1, nil
for _, key in ipairs({KEYS[9], KEYS[13]}) do
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local rec, e = cjson.decode(all[i + 1]), tonumber(all[i])
    local top = -1
    for _, s in ipairs(rec['f']) do
      if s ~= cjson.null and s > top then top = s end
    end
    endsteps[#endsteps + 1] = {e, top}
    if e > final_epoch then final_epoch, final = e, rec end
  end
end
local grant = {}
for r = 0, w - 1 do grant[r] = tonumber(redis.call('ZSCORE', KEYS[5], r) or floor) end
local pos = tonumber(ARGV[4])
local function boundary(skip_epoch)  -- each rank's last step, ENDs of epoch `skip_epoch` aside
  local lastend = -1
  for _, es in ipairs(endsteps) do
    if es[1] ~= skip_epoch and es[2] > lastend then lastend = es[2] end
  end
  local L = {}
  if pos >= 0 then
    for r = 0, w - 1 do L[r] = clamp(math.max(pos - 1, lastend)) end
    return L
  end
  local b = math.max(lastend, floor)
  for r = 0, w - 1 do
    if live[r] and grant[r] > b then b = grant[r] end
  end
  b = clamp(b)
  for r = 0, w - 1 do
    if live[r] then L[r] = b
    else L[r] = clamp(tonumber(redis.call('ZSCORE', KEYS[2], r) or -1)) end
  end
  return L
end
local function returned(L)  -- samples and tokens of the batches after each rank's last step
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
  return rs, rt
end
local L, rs, rt
local reopen = false
local holders = {}
if done and final and #final['f'] == w then
  for r = 0, w - 1 do
    local f = final['f'][r + 1]
    if live[r] and (f == cjson.null or grant[r] >= f) then holders[#holders + 1] = r end
  end
  if #holders == 0 then
    L = boundary(final_epoch)
    rs, rt = returned(L)
    reopen = rs > 0
  end
end
if not reopen then
  L = boundary(-1)
  rs, rt = returned(L)
  if done and rs > 0 then
    return redis.error_reply('ODB_PLANNED ' .. w .. ' ' .. table.concat(holders, ','))
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
if reopen then  -- the final END is void: the producer re-plans the epoch's rest in world ng
  redis.call('HDEL', KEYS[9], final_epoch)
  redis.call('HDEL', KEYS[13], final_epoch)
  redis.call('HSET', KEYS[1], 'state', 'planning')
  redis.call('HDEL', KEYS[1], 'pending_done')
  done = false
end
redis.call('HSET', KEYS[1], 'world_gen', ng, 'world_size', n, 'world_first', P + 1,
  'adopting', done and 0 or 1, 'lease_ranks', math.max(n, w), 'trim_floor', tf)
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
if done then redis.call('HSET', KEYS[8], ng .. ':adopted', now) end  -- nothing left to plan
return {1, old, new}
