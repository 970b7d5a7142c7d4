"""Cross-node delivery and the object-transfer cost per batch, on hosts made of network
namespaces (the multi-host harness of tests/hosts: the Kubernetes manifests' replicas, a Ray
head holding the CPUs, trainer hosts). Needs root and iproute2.

    .venv/bin/python bench/cross_node_bench.py [--quick] [--out bench/results/cross_node]

Three figures, one topology:
- cross-node delivery: 4 rank processes on the two trainer hosts consume a job of generated
  chats (15% with pictures) as fast as they can through `dns:///odb-pipeline-headless:50051`
  (TLS): tensor MB/s at the ranks, and what crossed the replicas' links (to the trainers; from
  the Ray nodes holding the payloads);
- the loopback figure beside it: the same job's twin consumed by 4 rank processes on the
  replica hosts themselves, dialling 127.0.0.1 (the payloads still cross from the Ray nodes,
  the delivery does not);
- the object-transfer cost per batch: a Ray driver on replica-b reads objects of a batch's
  size that live in the head's object store (another node: Ray's object manager, over the
  replica's link) and, as the baseline, objects of its own node's store.
Writes cross_node_bench{,_quick}.json and .png into --out (bench/results/cross_node for the
committed figures; else the cache dir). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
WORLD = 4

from results_dir import add_out_argument, out_dir  # noqa: E402

# What the tests' session sets for the Ray processes it starts (tests/conftest.py).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

PROBE = """
import json, statistics, sys, time
import numpy as np, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
me = ray.get_runtime_context().get_node_id()
head = next(n["NodeID"] for n in ray.nodes()
            if n["Alive"] and n["NodeManagerAddress"] == sys.argv[2])
@ray.remote(num_cpus=0)
def make(nbytes, salt):
    return np.full(nbytes, salt % 251, dtype=np.uint8)
out = {}
for mb in json.loads(sys.argv[3]):
    n = int(mb * 2**20)
    for where, node in (("other_node", head), ("same_node", me)):
        times = []
        for i in range(int(sys.argv[4])):
            ref = make.options(scheduling_strategy=On(node, soft=False)).remote(n, i)
            ray.wait([ref], fetch_local=False)  # made, not yet moved
            t = time.perf_counter()
            arr = ray.get(ref)
            times.append(time.perf_counter() - t)
            assert arr.nbytes == n
            del arr, ref
        out[f"{mb}MiB {where}"] = {"median_ms": 1000 * statistics.median(times),
                                   "mib_per_s": mb / statistics.median(times)}
print(json.dumps(out))
"""


def _consume(cluster, out: Path, job: str, hosts: list[str], target: str) -> dict:
    """4 rank processes of `job` on `hosts` (two each) dialling `target`, to the job's end."""
    from liveness.rank_process import RankProcess
    from liveness.scenario import assert_done, wait_ended

    env = cluster.trainer_env(job)
    ranks = [RankProcess(out, target, job, r, WORLD, options={"heartbeat_s": 0.5},
                         launcher=cluster.net.command(hosts[r // 2], []), env=env)
             for r in range(WORLD)]
    try:
        wait_ended(ranks, 900.0, f"{job} to be consumed")
        assert_done(ranks)
    finally:
        for r in ranks:
            r.kill()
    batches = [b for r in ranks for b in r.batches()]
    t0, t1 = min(b["t"] for b in batches), max(b["t"] for b in batches)
    mib = sum(b["nbytes"] for b in batches) / 2**20
    return {"batches": len(batches), "tensor_mib": round(mib, 1), "seconds": round(t1 - t0, 2),
            "tensor_mib_per_s": round(mib / (t1 - t0), 1),
            "mean_batch_mib": round(mib / len(batches), 3)}


def plot(result: dict, path: Path) -> None:
    """Delivery MiB/s across hosts beside loopback; an object's read time from another node
    beside its own node, per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [result["cross_node"]["tensor_mib_per_s"], result["loopback"]["tensor_mib_per_s"]]
    a.bar(["across hosts\n(dns:///, TLS)", "loopback\n(on the replica hosts)"], rates,
          color=["tab:blue", "tab:gray"])
    a.set_ylabel("tensor MiB/s at 4 ranks")
    a.set_title("delivery")
    probe = result["object_transfer_per_batch"]
    sizes = sorted({k.split(" ")[0] for k in probe}, key=lambda k: float(k[:-3]))
    xs = range(len(sizes))
    for off, where, color in ((-0.2, "other_node", "tab:blue"), (0.2, "same_node", "tab:gray")):
        b.bar([x + off for x in xs], [probe[f"{sz} {where}"]["median_ms"] for sz in sizes],
              0.4, label=where.replace("_", " "), color=color)
    b.set_xticks(list(xs), [f"{float(sz[:-3]):.2f} MiB" for sz in sizes])
    b.set_yscale("log")
    b.set_ylabel("ray.get median (ms)")
    b.set_title("one object, by where it lives")
    b.legend()
    fig.suptitle(result["command"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="600 chats instead of 3,000")
    ap.add_argument("--warm-s", type=float, default=None, metavar="S",
                    help="wait before consuming, while both jobs preprocess ahead (default: "
                         "90 s, 30 with --quick)")
    add_out_argument(ap, "cross_node")
    args = ap.parse_args()
    from hosts import network
    from hosts.cluster import REPLICAS, TRAINERS, Cluster

    reason = network.unavailable()
    if reason:
        print(f"cross_node_bench: cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    from pipeline.sample_data import IMAGES_DIR
    from pipeline.sample_data.generate import generate

    rows = 600 if args.quick else 3000
    tmp = Path(tempfile.mkdtemp(prefix="odb-xnode-"))
    data = tmp / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(
        rows, 11, image_prefix=str(IMAGES_DIR))))
    jobs = [{"job_id": job, "world_size": WORLD, "epochs": 1,
             "source": {"paths": [str(data)], "format": "jsonl"},
             "batching": {"token_budget": 8192, "pool_steps": 2}}
            for job in ("cross", "loop")]
    cluster = Cluster(tmp / "hosts", jobs)
    result: dict = {"command": "python bench/cross_node_bench.py" + (
        " --quick" if args.quick else ""), "rows": rows, "world_size": WORLD}
    try:
        t = time.monotonic()
        cluster.start()
        result["topology_ready_s"] = round(time.monotonic() - t, 1)
        # Both jobs' producers start with the replicas; their preprocessing runs ahead of the
        # ranks (up to the object store's budget). Measured at once, the first job would be
        # bound by preprocessing (~80 samples/s on the head's 2 CPUs) and the second not.
        warm = args.warm_s if args.warm_s is not None else (30.0 if args.quick else 90.0)
        print(f"cross_node_bench: {warm:.0f} s while both jobs preprocess ahead",
              file=sys.stderr, flush=True)
        time.sleep(warm)
        result["warm_s"] = warm
        links = [(h, n) for h in REPLICAS for n in ("front", "back")]
        before = {k: cluster.link_bytes(*k) for k in links}
        cross = result["cross_node"] = _consume(cluster, tmp, "cross", list(TRAINERS),
                                                cluster.headless)
        moved = {k: [(b - a) / 2**20 for a, b in zip(before[k], cluster.link_bytes(*k),
                                                     strict=True)] for k in links}
        # (front: the replica's link to the trainers; back: to the state and the Ray nodes)
        cross["replica_links_mib"] = {f"{h} {n}": {"received": round(m[0], 1),
                                                   "sent": round(m[1], 1)}
                                      for (h, n), m in moved.items()}
        cross["to_trainers_mib_per_s"] = round(
            sum(m[1] for (_, n), m in moved.items() if n == "front") / cross["seconds"], 1)
        port = cluster.replica_pod.port("grpc")
        result["loopback"] = _consume(cluster, tmp, "loop", list(REPLICAS),
                                      f"127.0.0.1:{port}")
        sizes = [result["cross_node"]["mean_batch_mib"], 1.0, 16.0]
        probe = cluster.net.run("replica-b", [
            sys.executable, "-c", PROBE, f"{cluster.addr('head', 'back')}:6379",
            cluster.addr("head", "back"), json.dumps(sizes), "5" if args.quick else "15"],
            cluster.env({"PYTHONPATH": str(ROOT)}), timeout=600)
        if probe.returncode != 0:
            raise RuntimeError(f"object probe failed:\n{probe.stderr[-3000:]}")
        result["object_transfer_per_batch"] = json.loads(probe.stdout.strip().splitlines()[-1])
    finally:
        result["left_behind"] = cluster.stop()
    result["load_avg_at_end"] = os.getloadavg()[0]
    result["cross_over_loopback"] = round(result["cross_node"]["tensor_mib_per_s"]
                                          / result["loopback"]["tensor_mib_per_s"], 2)
    stem = "cross_node_bench_quick" if args.quick else "cross_node_bench"
    out = out_dir(args, "cross_node")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{stem}.png")
    print(json.dumps(result, indent=2))
    return 0 if not result["left_behind"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
