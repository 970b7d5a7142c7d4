-- Visibility (fsync_publish): a held publication's steps, END records and `done` become what
-- readers see. `reveal(meta, ends, pending_ends)` (key names) moves `published_through` up to
-- `planned_through`, the pending END records into `ends` and a pending `done` into `state`;
-- returns the visible plan's last step.
local function reveal(meta, ends, pending_ends)
  local m = redis.call('HMGET', meta, 'planned_through', 'published_through', 'pending_done')
  local through = tonumber(m[2])
  local planned = tonumber(m[1] or m[2])
  if planned > through then
    redis.call('HSET', meta, 'published_through', planned)
    through = planned
  end
  local pe = redis.call('HGETALL', pending_ends)
  for j = 1, #pe, 2 do redis.call('HSETNX', ends, pe[j], pe[j + 1]) end
  if #pe > 0 then redis.call('DEL', pending_ends) end
  if m[3] == '1' then
    redis.call('HSET', meta, 'state', 'done')
    redis.call('HDEL', meta, 'pending_done')
  end
  return through
end
