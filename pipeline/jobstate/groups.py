"""A rank's model-parallel group as plain values: its seats, the lease the group holds and the
cursor its acks make (`interface.Member` states the contract). The model `MemoryJobState`
keeps and `coordinator/lua/lib/group.lua` follows; it touches no other state.

- A seat is never taken (`client_id` None), held (a client id, with its own lease expiry and
  ack), or released (`""`: its member got its END or ended cleanly).
- The group's lease (the rank's) expires with its first seat: a held seat at its own expiry, a
  seat nobody took yet at `absent_until` (`lease_seconds` after the group formed: a member that
  never connects is a lost one); released seats do not count. When no seat is held any more
  (its members released them) the group ends (`lease_expiry` None) and the rank has no lease.
- The group's cursor is the lowest of its seats' acks: a seat starts at the rank's cursor when
  the group forms, so a member that never connected, or that was lost, holds the group (and the
  payloads) where it left off, as a lost rank holds its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.jobstate.interface import GroupHealth, MemberHealth


def group_refused(job_id: str, rank: int, size: int, who: str, client_id: str,
                  asked: int) -> str:
    """`GroupRefused`'s message for two clients of one rank that disagree on its group size
    (`size` 1: a client holds the rank alone). The client retries it as it retries `RankHeld`:
    the other client may be a previous launch's, whose lease lapses (a live disagreement is
    raised after its `reconnect_timeout`)."""
    held = "by a client alone (group_size 1)" if size == 1 else f"by a group of {size}"
    return (f"group_size mismatch: job {job_id!r} rank {rank} is held {held}, {who}; "
            f"client {client_id!r} opened it with group_size {asked}. Every member of a rank's "
            "group must open with the same group_size (BatchStream(group_size=...))")


@dataclass
class Seat:
    client_id: str | None = None  # None: never taken; "": released
    expires_at: float = 0.0
    heartbeat_at: float = 0.0
    acked: int = -1

    @property
    def held(self) -> bool:
        return bool(self.client_id)

    def live(self, now: float) -> bool:
        return self.held and self.expires_at > now


@dataclass
class Group:
    size: int
    absent_until: float  # a seat nobody took yet counts as live until then
    seats: list[Seat] = field(default_factory=list)

    @classmethod
    def formed(cls, size: int, cursor: int, now: float, lease_seconds: float) -> Group:
        return cls(size, now + lease_seconds, [Seat(acked=cursor) for _ in range(size)])

    def live_seat(self, now: float) -> tuple[int, Seat] | None:
        """A seat held live (the first), if any: who a refused claim is told about."""
        return next(((j, s) for j, s in enumerate(self.seats) if s.live(now)), None)

    def lease_expiry(self) -> float | None:
        """When the group's lease expires: its first seat's expiry (see the module docstring);
        None once no seat is held (every member released its seat: the group ended)."""
        if not any(s.held for s in self.seats):
            return None
        return min(s.expires_at if s.held else self.absent_until
                   for s in self.seats if s.client_id != "")

    def cursor(self) -> int:
        return min(s.acked for s in self.seats)

    def health(self, rank: int, now: float) -> GroupHealth:
        return GroupHealth(rank, self.size, tuple(
            MemberHealth(j, s.client_id if s.held else None,
                         s.expires_at if s.held else None,
                         now - s.heartbeat_at if s.held else None,
                         max(0.0, now - s.expires_at) if s.held else 0.0, s.acked,
                         released=s.client_id == "")
            for j, s in enumerate(self.seats)))
