"""RayLauncher on several nodes: Ray's own ``cluster_utils.Cluster`` (two raylets on loopback).

One driver in a fresh interpreter starts the two-node cluster, runs every placement strategy on
it, a launch whose node-1 worker dies and one whose node-1 worker hangs, then stops the cluster; the test checks what each rank
saw. The session's Ray is not involved (a process has one Ray).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections import defaultdict
from typing import Any

import pytest

from tests.utils import distributed_test

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

DRIVER = """
    import json, os, time
    import ray, torch
    from ray.cluster_utils import Cluster
    from vllm_dist import CommunicatorType, CoordinatorType, LaunchError, RayLauncher
    from vllm_dist.tasks.base import GlobalCoordinatorDistributedTask

    class Where(GlobalCoordinatorDistributedTask):
        def post_init_distributed(self, exit_rank=-1, hang_rank=-1):
            info = self.worker_info
            if info.rank == exit_rank:
                os._exit(3)
            if hang_rank >= 0:
                self.coordinator.all_gather_object(0)
                if info.rank == hang_rank:
                    time.sleep(600)  # never arrives where rank 0 waits
                self.coordinator.all_gather_object(1)
            t = torch.full((4,), float(info.rank + 1))
            self.communicator.all_reduce(tensor_in=t)
            return {
                "node": ray.get_runtime_context().get_node_id(),
                "node_rank": info.node_rank,
                "local_rank": info.local_rank,
                "local_world_size": info.local_world_size,
                "sum": t.tolist(),
            }

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    )
    try:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        kw = {
            "coordinator_type": CoordinatorType.TORCH_DISTRIBUTED,
            "communicator_type": CommunicatorType.TORCH_DISTRIBUTED,
        }
        out = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
        for n, strategy in [(2, "STRICT_SPREAD"), (4, "PACK"), (2, "SPREAD"), (2, "STRICT_PACK")]:
            launcher = RayLauncher(n, placement_strategy=strategy, timeout=150)
            out[strategy] = launcher.launch(task_type=Where, **kw)
        try:
            RayLauncher(2, placement_strategy="STRICT_SPREAD", timeout=150).launch(
                task_type=Where, exit_rank=1, **kw
            )
        except LaunchError as exc:
            out["failed"] = {"ranks": exc.ranks, "text": str(exc)}
        try:
            RayLauncher(2, placement_strategy="STRICT_SPREAD", timeout=20).launch(
                task_type=Where, hang_rank=1, **kw
            )
        except LaunchError as exc:
            first = exc.failures[0]
            out["hung"] = {"first": first.rank, "stack": first.traceback, "text": str(exc)}
        ray.shutdown()
    finally:
        cluster.shutdown()
    print("RESULT", json.dumps(out))
"""


def _check_layout(results: list[dict[str, Any]], nodes: int) -> None:
    """Nodes numbered in rank order from 0; local ranks 0.. on each node; everyone summed."""
    world = len(results)
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_node[r["node"]].append(r)
    assert len(by_node) == nodes, results
    order = list(dict.fromkeys(r["node"] for r in results))
    for node_rank, node in enumerate(order):
        ranks = by_node[node]
        assert [r["node_rank"] for r in ranks] == [node_rank] * len(ranks)
        assert [r["local_rank"] for r in ranks] == list(range(len(ranks)))
        assert {r["local_world_size"] for r in ranks} == {len(ranks)}
    assert all(r["sum"] == [world * (world + 1) / 2] * 4 for r in results), results


@distributed_test(timeout=600)
def test_placement_strategies_and_node_facts_on_a_two_node_cluster() -> None:
    ray_tmp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths have a length limit
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(DRIVER)],
            env={**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": ""},
            capture_output=True,
            text=True,
            timeout=540,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["nodes"] == 2
    spread = out["STRICT_SPREAD"]
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"]) for r in spread] == [
        (0, 0, 1),
        (1, 0, 1),
    ]
    _check_layout(spread, nodes=2)
    _check_layout(out["PACK"], nodes=2)  # 4 ranks of 1 CPU on nodes of 2: both nodes, full
    spread_nodes = {r["node"] for r in out["SPREAD"]}  # SPREAD is best effort: Ray may pack
    _check_layout(out["SPREAD"], nodes=len(spread_nodes))
    _check_layout(out["STRICT_PACK"], nodes=1)
    failed = out["failed"]
    assert 1 in failed["ranks"] and "on node 1 (127.0.0.1" in failed["text"], failed
    hung = out["hung"]  # read on node 1 by an actor there
    assert hung["first"] == 1 and "post_init_distributed" in hung["stack"], hung
    assert "--- rank 1: still running (stopped by the launcher) [on node 1" in hung["text"], hung
