"""Deployment end to end: a SuperLink and SuperNodes as separate processes, TLS, node auth.

Each SuperNode runs in its own network namespace, with its own address on a
bridge, when this machine allows it (root and ``ip netns``); otherwise all run
on localhost with distinct ports (``FEDMITR_TEST_NETNS=0`` forces that).
Certificates and node keys come from the scripts the README's deployment recipe
uses (``deploy/``), the clients' data from ``fedmitr_core.export_partitions``, as
a user would make them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fedmitr_core.config import parse_config
from fedmitr_core.export_partitions import export_partitions
from tests.apps.network import Network, sh

BIN = Path(sys.executable).parent
FLWR = shutil.which("flwr") or str(BIN / "flwr")
FEDERATION = "fedmitr-deploy"
SITES = 4  # site-3 is killed while it trains


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (SuperNodes start ClientApps as children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


class Cluster:
    """Processes started for the test, all stopped by :meth:`close`."""

    def __init__(self, root: Path, repo: Path) -> None:
        self.root, self.repo = root, repo
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    # Several ClientApps share this machine's cores: one thread each,
                    # or torch's thread pools thrash (real sites have their own cores).
                    "OMP_NUM_THREADS": "1",
                    "FLWR_HOME": str(root / "cli-home")}

    def start(self, name: str, cmd: list[str], home: Path | None = None) -> subprocess.Popen:
        env = {**self.env, **({"FLWR_HOME": str(home)} if home else {})}
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=self.repo, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        for pid in reversed(_process_tree(self.procs[name].pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[name].wait(timeout=30)

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)

    def flwr(self, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
        return subprocess.run([FLWR, *args], capture_output=True, text=True, env=self.env,
                              cwd=self.repo, timeout=timeout, check=False)


def _json_out(proc: subprocess.CompletedProcess) -> dict | list:
    text = proc.stdout
    start = min(i for i in (text.find("{"), text.find("[")) if i >= 0)
    return json.loads(text[start:])


def _wait(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _superlink_up(url: str, ca: Path) -> bool:
    try:
        context = ssl.create_default_context(cafile=str(ca))
        return httpx.get(f"{url}/health", verify=context, timeout=1).is_success
    except httpx.HTTPError:
        return False


@pytest.mark.e2e
def test_tls_node_auth_deployment_survives_a_killed_supernode(tmp_path, repo_root, tiny,
                                                               free_port):
    run_config = {**tiny, "local-epochs": 20, "methods": "fedmitr", "min-clients": 3,
                  "round-timeout": 150.0, "output-dir": str(tmp_path / "outputs"),
                  "run-name": "deployed"}
    # The clients' data, written the way the README tells a user to.
    cfg = parse_config(run_config)
    npz_sites = export_partitions(cfg, SITES, tmp_path / "data-npz", "npz")
    tree_sites = export_partitions(cfg, SITES, tmp_path / "data-tree", "imagefolder")
    data_paths = [*npz_sites[:-1], tree_sites[-1]]  # both kinds of data-path in one run

    net = Network(SITES + 1)
    cluster = Cluster(tmp_path, repo_root)
    try:
        certs, keys = tmp_path / "certs", tmp_path / "keys"
        made = sh(str(repo_root / "deploy/generate_certs.sh"), str(certs), "localhost",
                   "127.0.0.1", net.host_ip)
        assert made.returncode == 0, made.stderr
        names = [f"site-{i}" for i in range(SITES)] + ["rogue"]
        made = sh(str(repo_root / "deploy/generate_node_keys.sh"), str(keys), *names)
        assert made.returncode == 0, made.stderr

        port = free_port()
        address = f"{net.host_ip}:{port}"
        cluster.start("superlink", [
            str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile",
            str(certs / "server.key"), "--enable-supernode-auth", "--host", "0.0.0.0",
            "--port", str(port), "--database", str(tmp_path / "superlink.db"),
            "--disable-runtime-dependency-installation"])
        _wait(lambda: _superlink_up(f"https://{address}", certs / "ca.crt"), 60,
              "the SuperLink")
        # TLS is on: plain HTTP gets no answer from the SuperLink.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{address}/health", timeout=2).raise_for_status()

        (tmp_path / "cli-home").mkdir(exist_ok=True)
        (tmp_path / "cli-home" / "config.toml").write_text(
            f'[superlink]\ndefault = "{FEDERATION}"\n\n[superlink.{FEDERATION}]\n'
            f'address = "{address}"\nroot-certificates = "{certs / "ca.crt"}"\n')
        node_ids = []
        for i in range(SITES):
            reg = cluster.flwr("supernode", "register", str(keys / f"site-{i}.pub"),
                               FEDERATION, "--format", "json")
            assert reg.returncode == 0, reg.stdout + reg.stderr
            node_ids.append(int(_json_out(reg)["node-id"]))

        def supernode(name: str, node: int, data_path: Path) -> None:
            cmd = [str(BIN / "flower-supernode"), "--superlink", address,
                   "--root-certificates", str(certs / "ca.crt"),
                   "--auth-supernode-private-key", str(keys / name),
                   "--port", str(free_port()), "--max-retries", "3",
                   "--node-config", f'data-path="{data_path}"']
            cluster.start(name, net.wrap(cmd, node), home=tmp_path / f"home-{name}")

        for i in range(SITES):
            supernode(f"site-{i}", i, data_paths[i])
        supernode("rogue", SITES, data_paths[0])

        def online() -> set[int]:
            nodes = _json_out(cluster.flwr("supernode", "list", FEDERATION, "--format",
                                           "json"))
            rows = nodes["nodes"] if isinstance(nodes, dict) else nodes
            return {int(r["node-id"]) for r in rows if r.get("status") == "online"}

        _wait(lambda: online() == set(node_ids), 90, "the registered SuperNodes")
        # The unregistered key is refused: that SuperNode gives up and never joins.
        assert cluster.procs["rogue"].wait(timeout=90) != 0
        assert "Failed to activate SuperNode" in cluster.log("rogue")
        assert "No SuperNode found with the given public key" in cluster.log("superlink")

        pairs = " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}"
                         for k, v in run_config.items())
        run = cluster.start("flwr-run", [FLWR, "run", ".", FEDERATION, "--stream",
                                         "--run-config", pairs])
        # Kill site-3 (the ImageFolder one) while its ClientApp is training.
        _wait(lambda: "Start `flwr-clientapp` process" in cluster.log("site-3"), 120,
              "site-3 to start training")
        time.sleep(3)
        assert "Sending: train message" not in cluster.log("site-3")
        cluster.kill("site-3")

        assert run.wait(timeout=240) == 0, cluster.log("flwr-run")[-4000:]
        run_dir = tmp_path / "outputs" / "deployed"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        uploads = metrics["uploads"]
        assert {a["node-id"] for a in uploads["accepted"]} == set(node_ids[:3])
        assert [f["node-id"] for f in uploads["failed"]] == [node_ids[3]]
        assert uploads["rejected"] == []
        assert (run_dir / "global_model.safetensors").is_file()
        assert len(list((run_dir / "uploads").glob("*.json"))) == 3
        results = metrics["results"]
        assert results["ensemble"]["accuracy"] > 0.2  # 10 classes: chance is 0.1
        assert results["fedmitr"]["accuracy"] > 0.1
        print(f"network: {'namespaces ' + net.subnet + '.0/24' if net.isolated else 'localhost'}"
              f"; failed node: {uploads['failed'][0]['reason']}")
    finally:
        cluster.close()
        net.close()
