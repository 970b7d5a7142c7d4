"""Run a real `odb-pipeline serve` inside a network namespace of its own, where the only
interface is a loopback, so that a bind to 0.0.0.0 reaches nothing beyond this process tree.

    unshare -rn python in_netns.py CONFIG.json ASK.json

ASK: {"http": [[path, Authorization header or null], ...], "status": [[arg, ...], ...]}: GETs
of the metrics port and `odb-pipeline status --metrics-endpoint <it> --json ARGS` runs, once
serve listens.
Prints one JSON object: {"output": serve's output, "http": [[code, body], ...] and "status":
[[exit status, stdout, stderr], ...] in the order asked, "listening": [[ip, port], ...] of
serve's listening TCP sockets, "grpc_port", "metrics_port"}. `netns_serve` (below) is how tests
run it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent


def netns_available() -> bool:
    return shutil.which("unshare") is not None and shutil.which("ip") is not None and \
        subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


def netns_serve(config: Path, http: list[tuple[str, str | None]] = (),
                status: list[list[str]] = (), env: dict[str, str] | None = None) -> dict:
    """Serve `config` in a fresh network namespace, ask, stop; the JSON report."""
    reqs = config.with_suffix(".ask.json")
    reqs.write_text(json.dumps({"http": list(http), "status": list(status)}))
    proc = subprocess.run(["unshare", "-rn", sys.executable, str(Path(__file__)), str(config),
                           str(reqs)], env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _get(url: str, authorization: str | None) -> list:
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as resp:
            return [resp.status, resp.read().decode()[:2000]]
    except urllib.error.HTTPError as exc:
        return [exc.code, exc.read().decode()[:2000]]


def main(config: str, ask_file: str) -> None:
    import psutil

    sys.path[:0] = [str(TESTS)]
    from support.serve_process import REPO, ServeProcess

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    serve = ServeProcess([sys.executable, "-m", "pipeline.cli", "serve", "--config", config],
                         env).start()
    ask = json.loads(Path(ask_file).read_text())
    try:
        metrics = f"127.0.0.1:{serve.metrics_port}"
        http = [_get(f"http://{metrics}{path}", auth) for path, auth in ask["http"]]
        status = []
        for args in ask["status"]:
            run = subprocess.run([sys.executable, "-m", "pipeline.cli", "status",
                                  "--metrics-endpoint", metrics, "--json", *args], env=env,
                                 capture_output=True, text=True, timeout=120)
            status.append([run.returncode, run.stdout, run.stderr])
        listening = sorted({(c.laddr.ip, c.laddr.port) for c in
                            psutil.Process(serve.proc.pid).net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN})
    finally:
        serve.stop()
    print(json.dumps({"output": serve.output(), "http": http, "status": status,
                      "listening": listening,
                      "grpc_port": serve.port, "metrics_port": serve.metrics_port}))


if __name__ == "__main__":
    main(*sys.argv[1:])
