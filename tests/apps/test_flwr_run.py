"""`flwr run .` end to end: a real local SuperLink, Ray-backed SuperNodes, the real apps."""

import json

import pytest
import yaml

from benchmarks.accuracy import run_benchmark
from tests.apps.flwr_cli import flwr_run, flwr_run_metrics, local_flwr_env, stop_local_superlink


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory, free_port):
    """A private FLWR_HOME and local-SuperLink ports; the SuperLink is stopped after."""
    env, control_port = local_flwr_env(tmp_path_factory.mktemp("flwr-home"), free_port)
    yield env
    stop_local_superlink(control_port)


@pytest.mark.e2e
def test_flwr_run_end_to_end(tmp_path, flwr_env, tiny):
    out = tmp_path / "outputs"
    run_config = {**tiny, "local-epochs": 30, "syn-images": 60, "distill-epochs": 10,
                  "methods": "fedmitr,deepinversion", "output-dir": str(out),
                  "run-name": "e2e"}
    proc = flwr_run(flwr_env, run_config, supernodes=4)
    log = proc.stdout + proc.stderr
    run_dir = out / "e2e"
    assert (run_dir / "metrics.json").is_file(), log[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "complete"
    assert len(metrics["uploads"]["accepted"]) == 4
    assert metrics["uploads"]["num-partitions"] == 4 and metrics["uploads"]["round"] == "closed"
    for name in ("global_model.safetensors", "config.yaml", "report.md",
                 "synthetic_grid.png", "label_distribution.png"):
        assert (run_dir / name).is_file(), name
    results = metrics["results"]
    # 10 classes: chance is 10 %.
    assert results["ensemble"]["accuracy"] > 0.3
    assert results["fedmitr"]["accuracy"] > 0.15
    assert "| fedmitr |" in log and "ETA" in log

    # A restarted server finishes from the persisted run without a round: here every
    # method had finished, so all is read back and the figures stay the same.
    resumed = flwr_run(flwr_env, {"resume-from": str(run_dir)}, supernodes=2)
    rlog = resumed.stdout + resumed.stderr
    assert "no client contacted" in rlog and "finished before the restart" in rlog, rlog[-3000:]
    assert "configure_train" not in rlog
    again = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert again["fedmitr"]["accuracy"] == results["fedmitr"]["accuracy"]

    # The benchmark runs the same client and server code: same seed, same figures.
    bench_config = {k: v for k, v in run_config.items() if k not in ("output-dir", "run-name")}
    preset = tmp_path / "same.yaml"
    preset.write_text(yaml.safe_dump({"run-config": bench_config, "sweep": {
        "num-clients": 4, "seeds": [0], "splits": [{"partitioner": "dirichlet", "alpha": 0.5}]}}))
    bench = run_benchmark(preset, results_root=tmp_path / "bench", cache_dir=tmp_path / "cache")
    for name in ("fedmitr", "deepinversion", "ensemble", "fedavg"):
        assert bench[0]["results"][name]["accuracy"] == pytest.approx(
            results[name]["accuracy"], abs=1e-6), name


@pytest.mark.e2e
def test_flwr_run_refuses_a_bad_alpha_naming_the_key(tmp_path, flwr_env):
    proc = flwr_run(flwr_env, {"alpha": -1, "output-dir": str(tmp_path / "o")}, supernodes=2,
                     timeout=300)
    log = proc.stdout + proc.stderr
    assert "run config key 'alpha'" in log, log[-3000:]
    assert not (tmp_path / "o").exists()


@pytest.mark.e2e
def test_a_failed_server_app_says_so_in_metrics_json_though_flwr_run_exits_0(tmp_path,
                                                                            flwr_env):
    # The data folder is missing: the ServerApp fails after creating the run folder.
    run_config = {"dataset": "imagefolder", "data-dir": str(tmp_path / "missing"),
                  "output-dir": str(tmp_path / "o"), "run-name": "failed"}
    proc = flwr_run(flwr_env, run_config, supernodes=2, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]  # Flower's behaviour: why the status exists
    metrics = json.loads((tmp_path / "o" / "failed" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "data-dir" in metrics["error"]
    assert "FedMITR run FAILED" in log


@pytest.mark.e2e
def test_dozens_of_supernodes_every_upload_accounted_for(tmp_path, flwr_env, tiny):
    """A Ray simulation with 48 SuperNodes on ~1.1k digits: tiny and empty partitions."""
    out = tmp_path / "outputs"
    run_config = {**tiny, "local-epochs": 40, "alpha": 0.1, "min-partition-size": 12,
                  "methods": "fedmitr", "teachers-per-class": 2, "output-dir": str(out),
                  "run-name": "many"}
    metrics, _ = flwr_run_metrics(flwr_env, run_config, supernodes=48,
                                  federation="client-resources-num-cpus=1")
    up = metrics["uploads"]
    assert up["num-partitions"] == 48
    assert len(up["accepted"]) + len(up["rejected"]) + len(up["failed"]) == 48
    assert up["failed"] == []
    # 'min-partition-size' 12 cannot hold for 48 Dirichlet(0.1) partitions of ~1.1k
    # images: the split is drawn without it, and the empty clients are named.
    assert all(r["reasons"] == ["metric 'num-examples' is 0: the client has no training "
                                "data (empty partition)"] for r in up["rejected"])
    assert metrics["num-teachers"] == len(up["accepted"])
    assert 0 < len(metrics["ensemble-teachers"]) <= 2 * 10
    assert metrics["results"]["ensemble"]["accuracy"] > 0.15
