"""Separate machines on one machine: a network namespace per node on a bridge.

Used by the end-to-end tests that start nodes as separate processes (the Flower
deployment, the Ray cluster). Isolation needs root and ``ip netns``; without them,
or with ``FEDMITR_TEST_NETNS=0``, every node runs on localhost.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess


def sh(*cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` run to completion, its output captured, never raising on failure."""
    return subprocess.run(cmd, capture_output=True, text=True, check=False)



class Network:
    """One network namespace per SuperNode on a bridge, or plain localhost."""

    def __init__(self, count: int) -> None:
        tag = f"{os.getpid() % 10000}{random.randint(0, 99)}"
        self.bridge = f"fmbr{tag}"
        self.namespaces = [f"fmns{tag}-{i}" for i in range(count)]
        used = sh("ip", "-4", "route").stdout if shutil.which("ip") else ""
        self.subnet = next(net for net in (f"10.{random.randint(100, 250)}."
                                           f"{random.randint(0, 250)}" for _ in range(100))
                           if f"{net}." not in used)
        wanted = os.environ.get("FEDMITR_TEST_NETNS", "1") != "0"  # 0: force localhost
        self.isolated = (wanted and os.geteuid() == 0 and shutil.which("ip") is not None
                         and self._setup())
        self.host_ip = f"{self.subnet}.1" if self.isolated else "127.0.0.1"

    def _setup(self) -> bool:
        steps = [("ip", "link", "add", self.bridge, "type", "bridge"),
                 ("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge),
                 ("ip", "link", "set", self.bridge, "up")]
        for i, ns in enumerate(self.namespaces):
            host_end, ns_end = f"fmh{self.bridge[4:]}{i}", f"fmn{self.bridge[4:]}{i}"
            steps += [("ip", "netns", "add", ns),
                      ("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end),
                      ("ip", "link", "set", ns_end, "netns", ns),
                      ("ip", "link", "set", host_end, "master", self.bridge),
                      ("ip", "link", "set", host_end, "up"),
                      ("ip", "netns", "exec", ns, "ip", "addr", "add",
                       f"{self.subnet}.{i + 2}/24", "dev", ns_end),
                      ("ip", "netns", "exec", ns, "ip", "link", "set", ns_end, "up"),
                      ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")]
        for step in steps:
            if sh(*step).returncode != 0:
                self.close()
                return False
        return True

    def wrap(self, cmd: list[str], node: int) -> list[str]:
        """``cmd`` run inside node ``node``'s namespace (unchanged on localhost)."""
        return ["ip", "netns", "exec", self.namespaces[node], *cmd] if self.isolated else cmd

    def close(self) -> None:
        for ns in self.namespaces:
            sh("ip", "netns", "del", ns)
        sh("ip", "link", "del", self.bridge)
