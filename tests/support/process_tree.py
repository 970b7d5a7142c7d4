"""What the tests read of other processes from /proc: a process's descendants, its state, its
name and command line. Every reader tolerates a process that exits meanwhile."""

from __future__ import annotations

from pathlib import Path

from pipeline.owned_processes import stat_fields


def descendants(pid: int) -> list[int]:
    """`pid`'s descendants now, parents before their children (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` ("T" = stopped), "" if it is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""


def comm(pid: int) -> str:
    """The process's name ("" if it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    """The process's command line, arguments joined by spaces ("" if it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""
