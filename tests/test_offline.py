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
    first = sorted(published.glob("*.safetensors"))[0]
    bad = {"pickled": b"\x80\x04\x95 not a safetensors file", "no-counts": None,
           "bad-json": "{'label-counts': [1,", "string-counts": {"label-counts": ["3"] * 10},
           "overflow": {"label-counts": [2**63] + [0] * 9}, "not-an-object": [1] * 10}
    for name, meta in bad.items():
        weights = meta if isinstance(meta, bytes) else first.read_bytes()
        (market / f"{name}.safetensors").write_bytes(weights)
        if meta is None:
            continue
        text = meta if isinstance(meta, str) else json.dumps(
            {"label-counts": [1] * 10} if isinstance(meta, bytes) else meta)
        (market / f"{name}.json").write_text(text)
    # A link to a checkpoint outside the folder is not followed.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.safetensors").write_bytes(first.read_bytes())
    (market / "linked.safetensors").symlink_to(outside / "secret.safetensors")
    (market / "linked.json").write_text(json.dumps({"label-counts": [1] * 10}))
    # A checkpoint published without token statistics is taken; the prior skips it.
    (market / "no-stats.safetensors").write_bytes(first.read_bytes())
    (market / "no-stats.json").write_text(json.dumps({"label-counts": [3] * 10}))
    lines = []
    out = distil_published(market, tmp_path / "run", {**tiny, **RUN, "methods": "fedavg"},
                           emit=lines.append)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    report = metrics["uploads"]
    assert len(report["accepted"]) == 4 and metrics["status"] == "complete"
    # Statistics files are read with their checkpoints, never as checkpoints.
    notes = {a["client-id"]: a["token-stats"] for a in report["accepted"]}
    assert notes == {**{f"partition-{i:04d}": "accepted" for i in range(3)},
                     "no-stats": "not shared"}
    assert any(line.startswith("note: no-stats.safetensors comes without token statistics")
               for line in lines)
    assert metrics["token-stats"]["without"] == ["no-stats"]
    reasons = {r["client-id"]: " ".join(r["reasons"]) for r in report["rejected"]}
    assert "not a readable safetensors file" in reasons["pickled"]
    assert "no no-counts.json" in reasons["no-counts"]
    assert "bad-json.json is not valid JSON" in reasons["bad-json"]
    assert "string-counts.json: 'label-counts' must be a list of whole numbers" in \
        reasons["string-counts"]
    assert "up to 2**40" in reasons["overflow"]
    assert "not-an-object.json must be a JSON object" in reasons["not-an-object"]
    assert "links outside the folder" in reasons["linked"]
    # Every rejection is on the console too, naming its file.
    for name in reasons:
        assert any(line.startswith(f"rejected {name}.safetensors: ") for line in lines), name
    assert 0.0 <= out.results["fedavg"]["accuracy"] <= 1.0


def test_a_market_with_no_valid_checkpoint_leaves_a_run_folder_marked_failed(published,
                                                                            tmp_path, tiny):
    market = tmp_path / "market"
    market.mkdir()
    first = sorted(published.glob("*.safetensors"))[0]
    (market / "a.safetensors").write_bytes(first.read_bytes())
    (market / "a.json").write_text("not json")
    with pytest.raises(ConfigError, match="no valid checkpoint"):
        distil_published(market, tmp_path / "run", {**tiny, **RUN}, emit=lambda _m: None)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "no valid checkpoint" in metrics["error"]
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_a_teacher_folder_without_checkpoints_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--teachers"):
        distil_published(tmp_path, tmp_path / "run", {}, emit=lambda _m: None)
