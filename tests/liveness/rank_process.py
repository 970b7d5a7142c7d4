"""One trainer rank as its own process, for the liveness scenarios: the script, and
`RankProcess`, the tests' handle on it.

A plain consumer of `trainer_client.BatchStream` (numpy tensors: no torch to import) that
appends one JSON line per event to `--out`, with the wall-clock time `t` of each, so a test can
freeze it, time what it saw, and count every sample id it received:
  {"start": pid, "dropped": [...]}            once (contract options this client does not know)
  {"epoch", "step", "ids", "digest", "reconnects", "nbytes", "t"}
                                              every batch, as the trainer takes it (with the
                                              stream's reconnects so far, its tensor bytes)
  {"paused": n, "t"}                          it took `--pause-after` batches and waits for --go
  {"end": epoch, "final_step", "reason", "world_size", "t"}   every END
  {"error": CODE, "details", "t"}             the stream ended with an error (exit 3)
  {"left": world_size, "t"}                   its world ended and it has no rank in the next
                                              (exit 4)
  {"done": true, "reconnects": n, "t"}        the job is done for this rank (exit 0)

`--pause-after N --go FILE`: after its N-th batch the rank holds that batch "in training" until
FILE exists (bounded), so a test can put a fault in while every rank is mid-epoch.
PIPELINE_TOKEN and PIPELINE_TLS_CA (a trainer pod's environment) give the stream its token and
the CA the service's certificate is checked against.
`--next-ranks '{"1": 0}'`: under shrink, the rank ids of the next world (the trainer's
rendezvous business): a rank whose world ended reopens as its new rank with the new size,
from its state_dict; a rank not in the map leaves.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer_client import BatchStream, Reconfigured, StreamError

GO_WAIT_S = 120.0  # a paused rank gives up waiting for its go file after this long
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class RankProcess:
    """A rank process started by a test; `records()` reads what it wrote so far."""

    def __init__(self, out_dir: Path, target: str, job: str, rank: int, world: int, *,
                 options: dict[str, Any], sleep: float = 0.0, pause_after: int = 0,
                 next_ranks: dict[int, int] | None = None, launcher: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        """`launcher`: a command prefix (e.g. `ip netns exec NS`); `env`: the process's
        environment (default: this one's), PYTHONPATH and OMP_NUM_THREADS added."""
        self.rank = rank
        self.out = out_dir / f"{job}-rank{rank}.jsonl"
        self.go = out_dir / f"{job}.go"
        cmd = [*launcher, sys.executable, str(HERE / "rank_process.py"), "--target", target,
               "--job", job,
               "--rank", str(rank), "--world", str(world), "--out", str(self.out),
               "--sleep", str(sleep), "--pause-after", str(pause_after), "--go", str(self.go),
               "--options", json.dumps(options),
               "--next-ranks", json.dumps({str(k): v for k, v in (next_ranks or {}).items()})]
        env = {**(os.environ if env is None else env), "PYTHONPATH": str(REPO),
               "OMP_NUM_THREADS": "1"}
        self.log = out_dir / f"{job}-rank{rank}.log"
        with open(self.log, "wb") as log:  # (a file, not a pipe nobody reads: it never blocks)
            # (A launcher's own process may fork the rank: a group of their own, killed whole.)
            self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT,
                                         start_new_session=bool(launcher))
        self._group = bool(launcher)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def records(self) -> list[dict]:
        if not self.out.exists():
            return []
        lines = self.out.read_text().splitlines()
        return [json.loads(ln) for ln in lines if ln.endswith("}")]  # (a line being written)

    def batches(self) -> list[dict]:
        return [r for r in self.records() if "step" in r]

    def last(self, key: str) -> dict | None:
        """The last record carrying `key` (e.g. "error", "done", "end")."""
        return next((r for r in reversed(self.records()) if key in r), None)

    def finished(self) -> bool:
        return self.proc.poll() is not None

    def output(self) -> str:
        """The end of what the process printed."""
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        if self._group:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
        elif self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # (it may be frozen)
            self.proc.kill()
        self.proc.wait(10)


def _credentials() -> dict[str, Any]:
    """A trainer pod's credentials (k8s/trainer-example): the job's token, the service's CA."""
    out: dict[str, Any] = {}
    if os.environ.get("PIPELINE_TOKEN"):
        out["token"] = os.environ["PIPELINE_TOKEN"]
    if os.environ.get("PIPELINE_TLS_CA"):
        out["root_certificates"] = Path(os.environ["PIPELINE_TLS_CA"]).read_bytes()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of 'training' per batch")
    p.add_argument("--pause-after", type=int, default=0)
    p.add_argument("--go", default="")
    p.add_argument("--options", default="{}", help="BatchStream keyword options (JSON)")
    p.add_argument("--next-ranks", default="{}", help="old rank -> rank in the next world")
    args = p.parse_args()
    wanted = json.loads(args.options)
    known = inspect.signature(BatchStream).parameters
    options = {k: v for k, v in wanted.items() if k in known}
    next_ranks = {int(k): v for k, v in json.loads(args.next_ranks).items()}

    log = open(args.out, "a")  # noqa: SIM115 - open for the process's life

    def emit(**rec: object) -> None:
        log.write(json.dumps({**rec, "t": time.time()}) + "\n")
        log.flush()

    def open_stream(rank: int, world: int) -> BatchStream:
        return BatchStream(args.target, args.job, rank, world, prefetch=2, tensors="numpy",
                           backoff=(0.05, 0.5), **_credentials(), **options)

    emit(start=os.getpid(), dropped=sorted(set(wanted) - set(options)))
    rank = args.rank
    stream = open_stream(rank, args.world)
    taken = 0
    try:
        while not stream.done:
            try:
                for batch in stream:
                    info = batch.info
                    emit(rank=rank, epoch=info.epoch, step=info.step,
                         ids=list(info.sample_ids), digest=batch.digest(),
                         reconnects=stream.reconnects, nbytes=batch.nbytes)
                    taken += 1
                    if taken == args.pause_after:
                        emit(paused=taken)
                        deadline = time.monotonic() + GO_WAIT_S
                        while not Path(args.go).exists() and time.monotonic() < deadline:
                            time.sleep(0.02)
                    time.sleep(args.sleep)
                end = stream.last_end
                assert end is not None
                emit(end=end.epoch, final_step=end.final_step, reason=end.reason,
                     world_size=end.world_size)
                if end.reason == "reconfigure":
                    raise Reconfigured(args.job, rank, end.world_size)
            except Reconfigured as exc:
                if rank not in next_ranks:
                    emit(left=exc.world_size)
                    stream.close()
                    return 4
                state = stream.state_dict()
                stream.close()
                rank = next_ranks.pop(rank)
                stream = open_stream(rank, exc.world_size)
                stream.load_state_dict(state)
    except StreamError as exc:
        emit(error=exc.code.name, details=exc.details)
        stream.close()
        return 3
    emit(done=True, reconnects=stream.reconnects)
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
