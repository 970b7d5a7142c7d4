-- Acks and heartbeats of many rank streams in one call (a replica's streams, grouped).
-- KEYS: meta, acked, lease_exp, lease, lapsed, counters, claimed, grants
-- ARGV: base, lease_ms, then (rank, client_id, step, renew) quadruples; step < 0: a heartbeat
-- (no cursor); renew '0': the client's lease is renewed only if it does not hold it live (a
-- replica renews on an ack only every so often: fewer writes, the same evidence).
-- Each is its client's sign of life; checked before anything of it is written: the rank
-- inside the world (the current one for an ack; for a heartbeat also the draining ranks of the
-- world it ended: ODB_RANK), no other client's live lease (ODB_HELD: a stream whose lease was
-- taken ends), and for an ack the step published (ODB_AHEAD) and within the rank's delivery
-- grant (ODB_UNSENT: a cursor never skips a step the rank was not sent). Then the lease is the
-- client's for lease_ms more (a lapse recorded when another client's lapsed lease is taken
-- over) and the cursor moves (monotonic). Returns one reply per entry: '' or its error; one
-- entry's error does not stop the others. Python model: MemoryJobState.ack_many.
--! include now
--! include trim
--! include lease
--! include ack_bounds
local exp = now + tonumber(ARGV[2])
local out, moved = {}, false
for i = 3, #ARGV, 4 do
  local rank, cid, step = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local err, took_over, held = rank_refusal(rank, step), false, false
  if not err then err, took_over, held = lease_check(rank, cid) end
  if not err then err = step_refusal(rank, step) end
  if err then
    out[#out + 1] = err
  else
    if ARGV[i + 3] == '1' or not held then lease_take(rank, cid, exp, took_over) end
    if step >= 0 then
      redis.call('ZADD', KEYS[2], 'GT', step, rank)
      moved = true
    end
    out[#out + 1] = ''
  end
end
if moved then trim() end
return out
