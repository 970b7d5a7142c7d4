"""The private Ray's node process: `ray start --head --block` in a process of its own.

`python -m pipeline.ray_node PARENT_PID RAY_START_ARGS...`, started by `PrivateRay` in a session
of its own. It first arranges to die with its parent (`owned_processes.die_with_parent`: done
here rather than in a pre-exec hook, since the parent may have threads by then), then runs
Ray's own CLI in this process. Ray's node processes die with it (Ray's kernel fate-sharing); on
SIGTERM it stops them itself.
"""

from __future__ import annotations

import sys

from pipeline.owned_processes import die_with_parent


def main(argv: list[str]) -> None:
    die_with_parent(int(argv[0]))
    from ray.scripts.scripts import main as ray_cli

    sys.argv = ["ray", "start", *argv[1:]]
    ray_cli()


if __name__ == "__main__":
    main(sys.argv[1:])
