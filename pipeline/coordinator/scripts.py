"""The Lua scripts (every multi-key change is one of these) and how they are called.

Each script is a file of `lua/` (one per script, named after it); shared fragments live in
`lua/lib/` and are spliced in where a script says `--! include <name>`. The comment at the top
of each file is its contract: KEYS, ARGV and the reply.

Scripts are loaded once per client and called by EVALSHA; after a Redis restart (scripts are not
persisted) the NOSCRIPT reply triggers one SCRIPT LOAD and a retry. Each script validates
everything before its first write, because a script that errors half-way is not rolled back.
Times come from the Redis clock (TIME), so leases mean the same to every replica and producer.
Errors are replies starting with a code (ODB_CONFLICT, ODB_FENCED, ...) that the caller maps to
the exceptions of `pipeline.errors`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis
from redis.exceptions import NoScriptError

_INCLUDE = re.compile(r"^--! include (\w+)$", re.MULTILINE)


def lua_source(name: str) -> str:
    """The source of script `name` (`lua/<name>.lua`) with its includes spliced in."""
    folder = resources.files(__package__) / "lua"

    def include(m: re.Match[str]) -> str:
        return (folder / "lib" / f"{m.group(1)}.lua").read_text().rstrip("\n")

    return _INCLUDE.sub(include, (folder / f"{name}.lua").read_text())


class Script:
    """One Lua source with its SHA1; `__call__` is one EVALSHA (plus a reload after NOSCRIPT)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    @classmethod
    def named(cls, name: str) -> Script:
        return cls(lua_source(name))

    def __call__(self, client: redis.Redis, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            # Redis restarted or SCRIPT FLUSH: load once and retry (every script is idempotent
            # or validated, so a retry cannot apply a change twice differently).
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)


register = Script.named("register")
producer_claim = Script.named("producer_claim")
producer_renew = Script.named("producer_renew")
producer_restart = Script.named("producer_restart")
set_error = Script.named("set_error")
publish = Script.named("publish")
reveal = Script.named("reveal")
ack = Script.named("ack")
ack_many = Script.named("ack_many")
release = Script.named("release")
lapsed = Script.named("lapsed")
health = Script.named("health")
sdo_organization = Script.named("sdo_organization")
sdo_epoch = Script.named("sdo_epoch")
scale = Script.named("scale")
grant = Script.named("grant")
left = Script.named("left")
member_ack_many = Script.named("member_ack_many")
member_release = Script.named("member_release")
group_health = Script.named("group_health")
