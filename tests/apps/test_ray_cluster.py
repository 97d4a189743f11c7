"""A simulation on a Ray cluster of two nodes: `flwr run .` attached through RAY_ADDRESS.

The README's recipe on one machine: a Ray head (`ray start --head`) and a second Ray
node (`ray start --address=...`) as separate processes, the second in its own network
namespace with its own address when this machine allows it (as the deployment test's
SuperNodes), then `flwr run .` with ``RAY_ADDRESS`` pointing at the head. Which node
ran which ClientApp comes from Ray's own records: the GCS actor table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.apps.flwr_cli import flwr_run_metrics, local_flwr_env, stop_local_superlink
from tests.apps.network import Network, sh

RAY = str(Path(sys.executable).parent / "ray")

# Run in a fresh interpreter attached to the cluster: which node each ClientApp actor
# ran on, from the GCS actor table (`ray.util.state` would need the dashboard, which
# `ray[default]` brings and `flwr[simulation]` does not).
ACTOR_NODES = """
import json, sys
import ray
from ray._private.state import actors
ray.init(address=sys.argv[1], logging_level="ERROR")
nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
print(json.dumps({"nodes": nodes,
                  "actors": [{"class": a["ActorClassName"], "node": a["Address"]["NodeID"]}
                             for a in actors().values()]}))
"""


class RayNodes:
    """Ray node processes started by the test, each in a session of its own."""

    def __init__(self, temp_dir: str, env: dict[str, str], logs: Path) -> None:
        self.temp_dir, self.env, self.logs = temp_dir, env, logs
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def leftovers(self) -> list[str]:
        """Command lines of processes still running from this cluster's temp dir."""
        found = sh("pgrep", "-af", self.temp_dir).stdout.splitlines()
        return [line for line in found if "pgrep" not in line]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        # Raylets, GCS and workers that outlived `ray start --block`: every one of them
        # has the temp dir in its command line, and nothing else does.
        deadline = time.monotonic() + 15
        while self.leftovers() and time.monotonic() < deadline:
            sh("pkill", "-f", self.temp_dir)
            time.sleep(1)
        if not self.leftovers():
            sh("rm", "-rf", self.temp_dir)


def _wait_for_nodes(address: str, count: int, env: dict, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        seen = subprocess.run([sys.executable, "-c", ACTOR_NODES, address], env=env,
                              capture_output=True, text=True, timeout=120)
        if seen.returncode == 0:
            records = json.loads(seen.stdout.strip().splitlines()[-1])
            if len(records["nodes"]) >= count:
                return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} Ray nodes did not join: {seen.stdout}{seen.stderr}")
        time.sleep(2)


@pytest.mark.e2e
def test_a_simulation_runs_clients_on_both_nodes_of_a_ray_cluster(tmp_path, free_port, tiny):
    net = Network(1)
    head_ip, node_ip = net.host_ip, (f"{net.subnet}.2" if net.isolated else "127.0.0.1")
    address = f"{head_ip}:{free_port()}"
    # Short: Ray puts unix sockets under it, and their paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="fmray", dir="/tmp")
    env, control_port = local_flwr_env(tmp_path / "flwr-home", free_port,
                                       RAY_ADDRESS=address, OMP_NUM_THREADS="1")
    nodes = RayNodes(temp_dir, env, tmp_path)
    common = ["--num-cpus=1", "--block", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    try:
        nodes.start("head", [RAY, "start", "--head", f"--node-ip-address={head_ip}",
                             f"--port={address.rsplit(':', 1)[1]}", "--include-dashboard=false",
                             *common])
        _wait_for_nodes(address, 1, env)
        nodes.start("worker", net.wrap([RAY, "start", f"--address={address}",
                                        f"--node-ip-address={node_ip}", *common], node=0))
        joined = _wait_for_nodes(address, 2, env)

        out = tmp_path / "outputs"
        run_config = {**tiny, "methods": "fedavg", "output-dir": str(out), "run-name": "ray"}
        # One CPU per ClientApp and one per node: one ClientApp at a time on each node.
        metrics, _ = flwr_run_metrics(env, run_config, supernodes=6,
                                      federation="client-resources-num-cpus=1")
        assert metrics["status"] == "complete"
        assert len(metrics["uploads"]["accepted"]) == 6

        records = _wait_for_nodes(address, 2, env)
        assert records["nodes"] == joined["nodes"]  # the run added no node of its own
        ran_on = {a["node"] for a in records["actors"] if a["class"] == "ClientAppActor"}
        assert ran_on == set(records["nodes"]), records  # ClientApps on both nodes
        assert {records["nodes"][n] for n in ran_on} == {head_ip, node_ip}
    finally:
        stop_local_superlink(control_port)
        nodes.close()
        net.close()
    assert not nodes.leftovers()
