"""The private Ray's node process: `ray start --head --block` in a process of its own.

`python -m pipeline.ray_node PARENT_PID RAY_START_ARGS...`, started by `PrivateRay` in a session
of its own. It first arranges to die with its parent (`owned_processes.die_with_parent`: done
here rather than in a pre-exec hook, since the parent may have threads by then), then runs
Ray's own CLI in this process, which stops Ray's processes on SIGTERM (the parent's stop, or
the parent's death); they also die with it (Ray's kernel fate-sharing).
"""

from __future__ import annotations

import signal
import sys

from pipeline.owned_processes import die_with_parent


def main(argv: list[str]) -> None:
    # SIGTERM, not SIGKILL: Ray's own stop then stops the raylet, which stops its workers and
    # agents (a SIGKILLed node leaves the raylet's agents running on their own).
    die_with_parent(int(argv[0]), signal.SIGTERM)
    from ray.scripts.scripts import main as ray_cli

    sys.argv = ["ray", "start", *argv[1:]]
    ray_cli()


if __name__ == "__main__":
    main(sys.argv[1:])
