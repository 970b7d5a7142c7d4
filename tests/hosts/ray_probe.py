"""A Ray driver on the head host that answers the multi-host suite's questions about the cluster:
one JSON request a line on stdin, one JSON answer a line on stdout.

    python ray_probe.py GCS_ADDRESS
    {"producer": JOB}  ->  {"pid", "generation", "outcome", "node_ip"}  (or {"error": ...})
    {"producer": JOB, "restart": true}  ->  the same, of the process Ray started after killing
                                            the one that ran (its placement decided anew)
    {"drivers": true}  ->  {"drivers": [{"pid", "node_ip"}]}: the live drivers (`serve`) and the
                           address of the node each reads its objects through

(`RayProbe` is the suite's handle on it: started once on the head host, asked in between.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


class RayProbe:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.ready = json.loads(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Ray probe exited ({self.proc.poll()})")
        return line

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def producer(self, job: str, restart: bool = False) -> dict[str, Any]:
        answer = self.ask(producer=job, restart=restart)
        if "error" in answer:
            raise RuntimeError(f"producer of {job}: {answer['error']}")
        return answer

    def driver_nodes(self) -> list[str]:
        """The node address of every live Ray driver (pids repeat: each pod has its own)."""
        return [d["node_ip"] for d in self.ask(drivers=True)["drivers"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def main() -> None:
    # Answers on a stdout of their own: whatever Ray prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import ray
    from ray._private import state

    from pipeline.producer.actor import NAMESPACE, actor_name

    ray.init(address=sys.argv[1], namespace=NAMESPACE, log_to_driver=False,
             configure_logging=False)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("drivers"):
            answer = {"drivers": [{"pid": j["DriverPid"], "node_ip": j["DriverIPAddress"]}
                                  for j in state.jobs() if not j["IsDead"]]}
            print(json.dumps(answer), file=answers, flush=True)
            continue
        try:
            handle = ray.get_actor(actor_name(request["producer"]), namespace=NAMESPACE)
            actor_id = handle._actor_id.hex()
            if request.get("restart"):
                restarts = int(state.actors(actor_id=actor_id).get("NumRestarts", 0))
                ray.kill(handle, no_restart=False)
                deadline = time.monotonic() + 60
                while (int(state.actors(actor_id=actor_id).get("NumRestarts", 0)) <= restarts
                       or state.actors(actor_id=actor_id).get("State") != "ALIVE"):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the producer was not restarted within 60 s")
                    time.sleep(0.2)
            answer = _info(handle)
            row = state.actors(actor_id=actor_id)
            answer["node_ip"] = row["Address"]["IPAddress"]
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=answers, flush=True)


def _info(handle: Any, timeout: float = 60.0) -> dict[str, Any]:
    """The actor's `info()`, once it answers (it may be restarting: Ray says so at once)."""
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(handle.info.remote(), timeout=30)
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


if __name__ == "__main__":
    main()
