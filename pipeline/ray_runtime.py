"""The one way this project starts or joins Ray (serve, demo, the one-shot CLI commands).

`PrivateRay` is a local Ray for one process's lifetime: no token-auth files in ~/.ray, workers
at normal priority (Ray's default nice 15 starves them next to any busy process), sessions in a
temp dir removed on exit. `join_cluster` connects to an existing cluster as a *driver on a Ray
node* (`ray.init(address=...)`), never through the Ray Client proxy (`ray://`), which would funnel
every payload byte through the head node.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from pipeline.errors import UserError

_PRIVATE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0",
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


def join_cluster(address: str) -> None:
    import ray

    if address.startswith("ray://"):
        raise UserError(f"ray.address {address!r}: a Ray Client address proxies every payload "
                        "byte through the head node; run the service on a Ray node and give "
                        "the GCS address (host:6379) or 'auto'")
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, configure_logging=False)


class PrivateRay:
    """A local Ray for this process (an already initialized Ray is reused and left running)."""

    def __init__(self, *, num_cpus: int | None = None, object_store_mb: int = 256,
                 prefix: str = "odb-ray-") -> None:
        self.num_cpus = num_cpus
        self.object_store_mb = object_store_mb
        self.prefix = prefix
        self.owned = False
        self.tmp: str | None = None

    def __enter__(self) -> PrivateRay:
        import ray

        self.owned = not ray.is_initialized()
        if self.owned:
            for k, v in _PRIVATE_ENV.items():
                os.environ.setdefault(k, v)
            self.tmp = tempfile.mkdtemp(prefix=self.prefix, dir="/tmp")
            ray.init(num_cpus=self.num_cpus, include_dashboard=False, _temp_dir=self.tmp,
                     log_to_driver=False, configure_logging=False,
                     object_store_memory=self.object_store_mb * 1024 * 1024)
            # Ray Data's per-dataset INFO/WARNING chatter is noise in a command's output.
            import ray.data  # configures its loggers on import: set the level after

            logging.getLogger("ray.data").setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.owned:
            import ray

            ray.shutdown()
            self.owned = False
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
