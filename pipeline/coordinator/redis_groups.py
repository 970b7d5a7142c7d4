"""Model-parallel groups in Redis, for `RedisJobState`: members' claims, acks and heartbeats
(MEMBER_ACK_MANY), their releases and exits (MEMBER_RELEASE), the seats read back
(GROUP_HEALTH), and the refusals as domain errors. The rules are `pipeline/jobstate/groups.py`'s
(`lua/lib/group.lua` follows them); the keys are in docs/redis-schema.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.coordinator import scripts
from pipeline.coordinator.connection import unavailable_as_error
from pipeline.errors import GroupRefused, RankHeld, UnknownJob
from pipeline.jobstate.groups import group_refused
from pipeline.jobstate.interface import (
    GROUP_HOLDER_PREFIX,
    GroupHealth,
    Member,
    MemberHealth,
    RankAck,
)

if TYPE_CHECKING:
    from pipeline.coordinator.redis_job_state import RedisJobState


def _pairs(flat: Sequence[bytes]) -> dict[str, str]:
    return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}


class RedisGroups:
    def __init__(self, state: RedisJobState) -> None:
        self.state = state
        k = state.keys
        self.keys = [k.meta, k.acked, k.lease_exp, k.lease, k.lapsed, k.counters, k.claimed,
                     k.grants, k.groups, k.members, k.member_exp, k.member_acked, k.draining,
                     k.lease_claim]

    def acks(self, acks: Sequence[RankAck], lease_seconds_ms: int, *, claims: bool = False
             ) -> list[Any]:
        """Per ack (each with a member of a group of two or more): (the seat's expiry in ms,
        its claim's number: 0 unless `claims`, the acks being the seats' Opens) or the error
        refusing it."""
        args: list[Any] = [self.state.keys.base, lease_seconds_ms]
        for a in acks:
            args += [a.rank, a.member.index, a.member.group_size, a.client_id, a.step,
                     "1" if a.renew else "0", "1" if claims else "0"]
        try:
            replies = self.state._run(scripts.member_ack_many, self.keys, args)
        except UnknownJob as exc:  # the job is gone: every ack gets the error
            return [exc] * len(acks)
        out: list[Any] = []
        for a, res in zip(acks, replies, strict=True):
            if isinstance(res, bytes | str):
                msg = res.decode() if isinstance(res, bytes) else res
                out.append(self.error(msg, a) or RuntimeError(msg))
            else:
                out.append((int(res[0]), int(res[1])))
        return out

    def release(self, rank: int, client_id: str, member: Member, generation: int = -1, *,
                claim: int | None = None) -> None:
        self.state._call(scripts.member_release, [*self.keys, self.state.keys.world_times],
                         [rank, member.index, member.group_size, client_id, generation,
                          "" if claim is None else claim])

    def error(self, msg: str, ack: RankAck) -> Exception | None:
        """A member's refusal (ODB_GROUP, ODB_MHELD); else the state's own mapping."""
        code, *rest = msg.split()
        job = self.state.job_id
        if code == "ODB_GROUP":
            size, live, client = int(rest[0]), int(rest[1]), " ".join(rest[2:])
            who = f"client {client!r}" if live < 0 else f"member {live} (client {client!r})"
            return GroupRefused(group_refused(job, ack.rank, size, who, ack.client_id,
                                              ack.member.group_size))
        if code == "ODB_MHELD":
            exp_ms, now_ms, j, holder = int(rest[0]), int(rest[1]), rest[2], " ".join(rest[3:])
            return RankHeld(f"job {job!r}: member {j} of rank {ack.rank}'s group is held by "
                            f"client {holder!r} for {(exp_ms - now_ms) / 1000:.1f}s more")
        return self.state._error_for(msg, ack.rank)

    def plain_refusal(self, held: RankHeld, rank: int, client_id: str) -> Exception:
        """A client alone was refused the rank (`RankHeld`): if a group of the current world
        holds it, the two disagree on its size (`GroupRefused`, naming a live member); else the
        refusal as it was (a client, or a group draining an ended world: wait for it)."""
        k = self.state.keys
        with unavailable_as_error(self.state._where):
            pipe = self.state.client.pipeline(transaction=True)
            pipe.hget(k.lease, rank)
            pipe.hget(k.draining, rank)
            lease, draining = pipe.execute()
        holder = lease.decode().partition(":")[2] if lease is not None else ""
        if not holder.startswith(GROUP_HOLDER_PREFIX) or (
                draining is not None and draining.decode() == holder):
            return held
        group = next((g for g in self.health() if g.rank == rank), None)
        live = None if group is None else next(
            (m for m in group.members if m.client_id and m.lapsed_for == 0.0), None)
        who = "its members" if live is None else f"member {live.index} (client {live.client_id!r})"
        return GroupRefused(group_refused(self.state.job_id, rank,
                                          int(holder[len(GROUP_HOLDER_PREFIX):]), who,
                                          client_id, 1))

    def health(self) -> list[GroupHealth]:
        k = self.state.keys
        now_ms, ws, lease, groups, members, exps, acked = self.state._run(
            scripts.group_health, [k.meta, k.lease, k.groups, k.members, k.member_exp,
                                   k.member_acked], [])
        lease, groups = _pairs(lease), _pairs(groups)
        members, exps, acked = _pairs(members), _pairs(exps), _pairs(acked)
        out = []
        for r in range(int(ws or 0)):
            g = groups.get(str(r))
            if g is None:
                continue
            size = int(g.partition(":")[0])
            if lease.get(str(r), "").partition(":")[2] != f"{GROUP_HOLDER_PREFIX}{size}":
                continue  # a stale record: the rank's lease is not the group's
            seats = []
            for j in range(size):
                f = f"{r}:{j}"
                hb, _, cid = members[f].partition(":") if f in members else ("", "", None)
                exp = int(exps[f]) if cid and f in exps else None
                seats.append(MemberHealth(
                    j, cid or None, exp / 1000.0 if exp is not None else None,
                    (int(now_ms) - int(hb)) / 1000.0 if cid else None,
                    max(0.0, (int(now_ms) - exp) / 1000.0) if exp is not None else 0.0,
                    int(acked.get(f, -1)), released=cid == ""))
            out.append(GroupHealth(r, size, tuple(seats)))
        return out
