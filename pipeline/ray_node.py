"""The private Ray's node process: `ray start --head --block` in a process of its own.

`python -m pipeline.ray_node PARENT_PID RAY_START_ARGS...`, started by `PrivateRay` in a session
of its own. It first arranges to die with its parent (`owned_processes.die_with_parent`: done
here rather than in a pre-exec hook, since the parent may have threads by then), then runs
Ray's own CLI in this process, which stops Ray's processes on SIGTERM (the parent's stop, or
the parent's death); they also die with it (Ray's kernel fate-sharing).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys

from pipeline.owned_processes import die_with_parent


def main(argv: list[str]) -> None:
    parent = int(argv[0])
    # SIGTERM, not SIGKILL: Ray's own stop then stops the raylet, which stops its workers and
    # agents (a SIGKILLed node leaves the raylet's agents running on their own).
    die_with_parent(parent, signal.SIGTERM)
    temp_dir = argv[argv.index("--temp-dir") + 1]
    atexit.register(_remove_if_orphaned, parent, temp_dir)
    from ray.scripts.scripts import main as ray_cli

    sys.argv = ["ray", "start", *argv[1:]]
    ray_cli()


def _remove_if_orphaned(parent: int, temp_dir: str) -> None:
    """At exit, after Ray's own stop: the temp dir goes if the parent is gone (killed: no one
    else will remove it); a live parent removes it itself, once it has read the node's log."""
    if os.getppid() != parent:
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
