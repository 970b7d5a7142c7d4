"""dev fits one small node (4 CPUs, 8 GiB) even with Ray scaled out; prod gives every container
requests and a memory limit."""

from __future__ import annotations

from k8s_support import containers, of_kind, overlay, parse_cpu, parse_mem

SMALL_NODE_CPU = 4.0
SMALL_NODE_MEM = 8 * 2**30


def _replicas(pod, objs) -> int:
    kind, *_, name = pod.owner.split("/")
    if kind == "RayCluster":
        if pod.labels["ray.io/node-type"] == "head":
            return 1
        (ray,) = of_kind(objs, "RayCluster")
        group = next(g for g in ray["spec"]["workerGroupSpecs"]
                     if g["groupName"] == pod.labels["ray.io/group"])
        return group["maxReplicas"]
    obj = next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)
    return obj["spec"].get("parallelism", obj["spec"].get("replicas", 1))


def test_dev_fits_one_small_node_at_max_scale():
    objs = overlay("dev")
    cpu = mem = 0.0
    for pod, c in containers(objs):
        n = _replicas(pod, objs)
        req = c.get("resources", {}).get("requests", {})
        cpu += n * parse_cpu(req.get("cpu", 0))
        mem += n * parse_mem(req.get("memory", 0))
    (ray,) = of_kind(objs, "RayCluster")  # + the autoscaler sidecar KubeRay adds to the head
    auto = ray["spec"]["autoscalerOptions"]["resources"]["requests"]
    cpu += parse_cpu(auto["cpu"])
    mem += parse_mem(auto["memory"])
    assert cpu <= SMALL_NODE_CPU, f"dev requests {cpu} CPUs"
    assert mem <= SMALL_NODE_MEM, f"dev requests {mem / 2**30:.2f} GiB"


def test_prod_containers_have_requests_and_memory_limits():
    for pod, c in containers(overlay("prod")):
        res = c.get("resources", {})
        assert {"cpu", "memory"} <= res.get("requests", {}).keys(), f"{pod.owner}/{c['name']}"
        assert "memory" in res.get("limits", {}), f"{pod.owner}/{c['name']}"
        assert parse_mem(res["limits"]["memory"]) >= parse_mem(res["requests"]["memory"])
