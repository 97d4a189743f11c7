"""The offline commands: resume a server killed with SIGKILL; distil published checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from benchmarks.upload_cache import cached_uploads
from fedmitr_core.config import ConfigError, parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.offline import distil_published

RUN = {"methods": "fedmitr", "syn-images": 40, "distill-epochs": 60, "checkpoint-every": 2}


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny):
    """A folder of client checkpoints (safetensors + label counts), as clients publish them."""
    cfg = parse_config({**tiny, "local-epochs": 10})
    folder, _ = cached_uploads(cfg, 3, load_dataset(cfg.data, cfg.seed),
                               tmp_path_factory.mktemp("cache"), log=lambda _m: None)
    return folder / "uploads"


def _offline(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedmitr_core.offline", *args]


def _run_config(pairs: dict) -> list[str]:
    return [f"{k}={v}" for k, v in pairs.items()]


@pytest.mark.e2e
def test_sigkill_during_distillation_then_resume_equals_an_uninterrupted_run(published, tmp_path,
                                                                             tiny, repo_root):
    run = {**tiny, **RUN}
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_offline("--teachers", str(published), "--out", str(full), "--run-config",
                            *_run_config(run)), cwd=repo_root, check=True, capture_output=True)

    proc = subprocess.Popen(_offline("--teachers", str(published), "--out", str(killed),
                                     "--run-config", *_run_config(run)),
                            cwd=repo_root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = killed / "state" / "fedmitr" / "distill.pt"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "metrics.json").exists()
    assert (killed / "state" / "pools" / "sparse-inversion.safetensors").is_file()

    resumed = subprocess.run(_offline("--resume-from", str(killed)), cwd=repo_root, check=True,
                             capture_output=True, text=True)
    log = resumed.stdout + resumed.stderr
    assert "read from" in log and "resumed from the checkpoint after it" in log

    a = json.loads((full / "metrics.json").read_text())["results"]
    b = json.loads((killed / "metrics.json").read_text())["results"]
    assert b["fedmitr"]["accuracy"] == a["fedmitr"]["accuracy"]
    wa = load_file(str(full / "global_model.safetensors"))
    wb = load_file(str(killed / "global_model.safetensors"))
    assert all((wa[k] - wb[k]).abs().max() < 1e-6 for k in wa)


def test_published_checkpoints_are_validated_and_bad_ones_left_out(published, tmp_path, tiny):
    market = tmp_path / "market"
    market.mkdir()
    for f in published.iterdir():
        (market / f.name).write_bytes(f.read_bytes())
    (market / "pickled.safetensors").write_bytes(b"\x80\x04\x95 not a safetensors file")
    (market / "pickled.json").write_text(json.dumps({"label-counts": [1] * 10}))
    first = sorted(published.glob("*.safetensors"))[0]
    (market / "no-counts.safetensors").write_bytes(first.read_bytes())
    out = distil_published(market, tmp_path / "run", {**tiny, **RUN, "methods": "fedavg"},
                           emit=lambda _m: None)
    report = json.loads((tmp_path / "run" / "metrics.json").read_text())["uploads"]
    assert len(report["accepted"]) == 3
    reasons = {r["client-id"]: " ".join(r["reasons"]) for r in report["rejected"]}
    assert "not a readable safetensors file" in reasons["pickled"]
    assert "label-counts" in reasons["no-counts"]
    assert 0.0 <= out.results["fedavg"]["accuracy"] <= 1.0


def test_a_teacher_folder_without_checkpoints_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--teachers"):
        distil_published(tmp_path, tmp_path / "run", {}, emit=lambda _m: None)
