"""The privacy audit of a finished benchmark run: every pool and method model audited."""

import json

import yaml

from benchmarks.accuracy import run_benchmark
from benchmarks.privacy_audit import main


def test_a_finished_benchmark_run_is_audited_pool_by_pool_and_model_by_model(tiny, tmp_path):
    preset = tmp_path / "tiny.yaml"
    preset.write_text(yaml.safe_dump({
        "run-config": {**tiny, "local-epochs": 3, "methods": "fedmitr,deepinversion",
                       "privacy-audit": True},
        "sweep": {"num-clients": 3, "seeds": [0],
                  "splits": [{"partitioner": "dirichlet", "alpha": 0.5}]}}))
    run_benchmark(preset, results_root=tmp_path / "results", cache_dir=tmp_path / "cache")
    results = tmp_path / "results" / "tiny"
    # The benchmark summarised the audits the runs made (privacy-audit=true) on its own.
    summary = json.loads((results / "audit" / "audit.json").read_text())
    assert [r["run"] for r in summary] == ["dir-0.5-seed0"]
    assert (results / "runs" / "dir-0.5-seed0" / "privacy_pairs.png").is_file()
    main([str(results)])
    records = json.loads((results / "audit" / "audit.json").read_text())
    assert [r["run"] for r in records] == ["dir-0.5-seed0"]
    rec = records[0]
    assert set(rec["pools"]) == {"sparse-inversion", "dense-inversion"}
    assert rec["method-pools"] == {"fedmitr": "sparse-inversion",
                                   "deepinversion": "dense-inversion"}
    for spaces in rec["pools"].values():
        for figures in spaces.values():
            # Synthetic images made from noise in 20 steps copy no training image.
            assert 0.0 < figures["pool-attack-auc"] < 1.0
            assert figures["pool-to-train-median"] > 0.0
    assert set(rec["loss-attack-auc"]) == {"fedmitr", "deepinversion"}
    # The clients' own uploads, read from the run's metrics.json (privacy-audit=true).
    assert sorted(rec["clients"]) == [f"partition-{i:04d}" for i in range(3)]
    table = (results / "audit" / "audit.md").read_text()
    assert "| dir-0.5 | sparse-inversion (pixel) |" in table and "| dir-0.5 | fedmitr |" in table
    assert "## The clients' own uploads" in table
    assert (results / "audit" / "audit.png").is_file()
