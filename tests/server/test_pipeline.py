"""The one server pipeline: the same call after a round, after a crash, in the benchmark."""

import json

import pytest

from benchmarks.upload_cache import cached_uploads
from fedmitr_core.config import ConfigError, parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.server.pipeline import make_run_dir, resolve_run_dir, run_pipeline, run_status


@pytest.fixture(scope="module")
def uploads(tmp_path_factory, tiny):
    cfg = parse_config({**tiny, "local-epochs": 3, "methods": "fedavg,kd-real",
                        "distill-epochs": 1})
    data = load_dataset(cfg.data, cfg.seed)
    folder, cached = cached_uploads(cfg, 3, data, tmp_path_factory.mktemp("cache"),
                                    log=lambda _m: None)
    assert not cached
    return cfg, data, folder


def test_pipeline_reads_the_uploads_and_their_account_from_the_source(uploads, tmp_path):
    cfg, data, source = uploads
    lines = []
    out = run_pipeline(cfg, data, tmp_path / "run", emit=lines.append, source=source)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    screening = metrics["uploads"].pop("screening")
    assert metrics["uploads"] == json.loads((source / "upload_report.json").read_text())
    assert screening == {"dropped": [], "capped": [], "notes": []}
    assert metrics["status"] == "complete"
    assert len(metrics["uploads"]["accepted"]) == metrics["num-teachers"] == 3
    assert list(out.results) == ["fedavg", "kd-real", "ensemble", "local-mean"]
    assert metrics["ensemble-form"] == "loop" and metrics["global-method"] == "fedavg"
    for name in ("global_model.safetensors", "config.yaml", "report.md",
                 "label_distribution.png"):
        assert (tmp_path / "run" / name).is_file(), name
    assert any(line.startswith("results (test top-1)") for line in lines)


def test_a_resumed_pipeline_reads_finished_methods_back(uploads, tmp_path):
    cfg, data, source = uploads
    first = run_pipeline(cfg, data, tmp_path / "run", source=source)
    lines = []
    again = run_pipeline(cfg, data, tmp_path / "run", emit=lines.append, resume=True,
                         source=source)
    assert sum("finished before the restart" in line for line in lines) == 2
    assert again.results["kd-real"]["accuracy"] == first.results["kd-real"]["accuracy"]
    for key in ("seconds", "cpu-seconds"):
        assert again.results["kd-real"][key] == first.results["kd-real"][key] > 0.0


def test_run_folder_is_output_dir_and_run_name_relative_to_the_app(tmp_path):
    cfg = parse_config({"output-dir": "outs", "run-name": "r1"})
    assert resolve_run_dir(cfg, tmp_path) == (tmp_path / "outs" / "r1").resolve()
    absolute = parse_config({"output-dir": str(tmp_path / "abs"), "run-name": "r2"})
    assert resolve_run_dir(absolute, tmp_path / "elsewhere") == tmp_path / "abs" / "r2"


def test_an_output_dir_or_run_name_that_names_a_file_is_refused_naming_the_key(tmp_path):
    (tmp_path / "a-file").write_text("x")
    cfg = parse_config({"output-dir": str(tmp_path / "a-file"), "run-name": "r"})
    with pytest.raises(ConfigError, match="'output-dir'.*is a file"):
        make_run_dir(cfg, tmp_path)
    (tmp_path / "outs").mkdir()
    (tmp_path / "outs" / "r").write_text("x")
    cfg = parse_config({"output-dir": str(tmp_path / "outs"), "run-name": "r"})
    with pytest.raises(ConfigError, match="'run-name'"):
        make_run_dir(cfg, tmp_path)
    cfg = parse_config({"output-dir": str(tmp_path / "new" / "deeper"), "run-name": "r"})
    assert make_run_dir(cfg, tmp_path).is_dir()


def test_the_status_says_whether_a_method_failed_and_whether_a_model_was_saved():
    ok, failed = {"accuracy": 0.5}, {"accuracy": None, "error": "loss is nan"}
    assert run_status({"fedmitr": ok, "fedavg": ok}, ("fedmitr", "fedavg")) == "complete"
    assert run_status({"fedmitr": failed, "fedavg": ok}, ("fedmitr", "fedavg")) == "partial"
    assert run_status({"fedmitr": failed}, ("fedmitr", "fedavg-rounds")) == "failed"


def test_the_privacy_audit_runs_when_asked_and_lands_in_metrics_json(uploads, tmp_path, tiny):
    cfg, data, source = uploads
    audited = parse_config({**cfg.to_flat(), "methods": "deepinversion",
                            "privacy-audit": True})
    lines = []
    run_pipeline(audited, data, tmp_path / "run", emit=lines.append, source=source)
    audit = json.loads((tmp_path / "run" / "metrics.json").read_text())["privacy-audit"]
    assert audit["method-pools"] == {"deepinversion": "dense-inversion"}
    assert 0.0 < audit["pools"]["dense-inversion"]["pixel"]["pool-attack-auc"] < 1.0
    assert 0.0 < audit["loss-attack-auc"]["deepinversion"] < 1.0
    assert 0.0 <= audit["loss-attack-tpr"]["deepinversion"] <= 1.0
    assert any(line.startswith("privacy audit: deepinversion: loss attack AUC")
               for line in lines)
    # The clients' own uploads: every one attacked with its own images as members.
    clients = audit["clients"]
    assert sorted(clients) == [f"partition-{i:04d}" for i in range(3)]
    for row in clients.values():
        assert row["members"] > 0
        assert 0.0 < row["loss-attack-auc"] < 1.0 and 0.0 < row["stats-attack-auc"] < 1.0
    assert any("tracing attack on their token statistics" in line for line in lines)
    assert (tmp_path / "run" / "privacy_pairs.png").is_file()
    run_pipeline(cfg, data, tmp_path / "plain", source=source)
    assert "privacy-audit" not in json.loads((tmp_path / "plain" / "metrics.json").read_text())
