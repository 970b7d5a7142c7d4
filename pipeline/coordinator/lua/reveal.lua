-- Make every held publication visible (fsync_publish: called once WAITAOF confirmed them on
-- disk, and by a producer that starts, after a crash between a publication and its reveal).
-- KEYS: meta, ends, pending_ends. ARGV: generation. Only the current producer generation may
-- reveal (an expired lease nobody took over is still its own: nothing newer exists).
-- Returns published_through.
--! include reveal
local g = redis.call('HGET', KEYS[1], 'producer_gen')
if not g then return redis.error_reply('ODB_NOJOB') end
if g ~= ARGV[1] then return redis.error_reply('ODB_FENCED ' .. ARGV[1] .. ' ' .. g) end
return reveal(KEYS[1], KEYS[2], KEYS[3])
