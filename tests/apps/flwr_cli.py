"""`flwr run .` from the tests: a private FLWR_HOME, local-SuperLink ports, the CLI call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # `flwr run .` runs the app in this checkout
FLWR = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")


def run_config_arg(pairs: dict) -> str:
    """``pairs`` as the text of ``flwr run --run-config`` (strings quoted, bools lower)."""

    def fmt(v):
        return f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    return " ".join(f"{k}={fmt(v)}" for k, v in pairs.items())


def local_flwr_env(home: Path, free_port: Callable[[], int], **extra: str
                   ) -> tuple[dict[str, str], int]:
    """An environment for ``flwr`` whose local SuperLink is private to the caller.

    Returns the environment (``extra`` added) and the SuperLink's control port, which
    :func:`stop_local_superlink` needs. The SuperLink ``flwr run`` starts inherits this
    environment, and so do the simulation and its ``ray.init()``.
    """
    control_port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # flwr starts flower-superlink from PATH
    env = {**os.environ,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_HOME": str(home),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control_port), **extra}
    return env, control_port


def stop_local_superlink(control_port: int) -> None:
    """Stop the local SuperLink that ``flwr run`` started on ``control_port``."""
    subprocess.run(["pkill", "-f", f"control-api-address 127.0.0.1:{control_port}"],
                   check=False)


def flwr_run(env: dict, run_config: dict, supernodes: int, timeout: int = 600,
             federation: str = "") -> subprocess.CompletedProcess:
    """``flwr run . --stream`` in this checkout with ``supernodes`` simulated SuperNodes."""
    cmd = [FLWR, "run", ".", "--stream",
           "--federation-config", f"num-supernodes={supernodes} {federation}".strip(),
           "--run-config", run_config_arg(run_config)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def flwr_run_metrics(env: dict, run_config: dict, supernodes: int, federation: str = ""
                     ) -> tuple[dict, str]:
    """:func:`flwr_run`, then the run's ``metrics.json`` and the CLI's log.

    ``run_config`` must name ``output-dir`` and ``run-name``; a run that wrote no
    ``metrics.json`` fails the calling test with the log's tail.
    """
    proc = flwr_run(env, run_config, supernodes, federation=federation)
    log = proc.stdout + proc.stderr
    metrics_file = Path(run_config["output-dir"]) / run_config["run-name"] / "metrics.json"
    assert metrics_file.is_file(), log[-4000:]
    return json.loads(metrics_file.read_text()), log
