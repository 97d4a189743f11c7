"""The accuracy benchmark: preset validation, the upload cache, and its tables."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.accuracy import (
    lead_table,
    load_sweep,
    main,
    merge_variants,
    run_benchmark,
    seconds_table,
    seed_table,
    split_name,
    summary_table,
)
from benchmarks.upload_cache import client_key, uploads_digest
from fedmitr_core.config import SIM_CONFIGS_DIR, ConfigError, parse_config


def _preset(tmp_path: Path, run_config: dict, sweep: dict, name: str = "tiny") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"run-config": run_config, "sweep": sweep}))
    return path


SWEEP = {"num-clients": 3, "seeds": [0],
         "splits": [{"partitioner": "dirichlet", "alpha": 0.5}]}


@pytest.mark.parametrize(("run_config", "sweep", "named"), [
    ({"alphaa": 0.1}, SWEEP, "alphaa"),
    ({}, {**SWEEP, "seed": [0]}, "seed"),
    ({}, {k: v for k, v in SWEEP.items() if k != "splits"}, "splits"),
    ({}, {**SWEEP, "splits": [{"partitioner": "dirichlet", "alpha": -1}]}, "alpha"),
    ({"methods": "fedmitr,dense-typo"}, SWEEP, "methods"),
])
def test_a_bad_preset_fails_naming_the_key(tmp_path, run_config, sweep, named):
    with pytest.raises(ConfigError, match=f"'{named}'"):
        load_sweep(_preset(tmp_path, run_config, sweep))


def test_clients_are_trained_once_then_read_from_the_cache(tiny, tmp_path):
    preset = _preset(tmp_path, {**tiny, "local-epochs": 3, "methods": "fedavg"}, SWEEP)
    kwargs = {"results_root": tmp_path / "results", "cache_dir": tmp_path / "cache"}
    first = run_benchmark(preset, **kwargs)
    cache_entries = list((tmp_path / "cache").iterdir())
    second = run_benchmark(preset, **kwargs)
    assert [r["cached"] for r in first] == [False]
    assert [r["cached"] for r in second] == [True]
    assert list((tmp_path / "cache").iterdir()) == cache_entries
    # The same uploads give the same one-shot FedAvg and ensemble.
    for name in ("fedavg", "ensemble", "local-mean"):
        assert second[0]["results"][name]["accuracy"] == first[0]["results"][name]["accuracy"]
    # A server-side change reuses the clients; a client-side change does not.
    third = run_benchmark(preset, overrides={"temperature": 2.0}, **kwargs)
    fourth = run_benchmark(preset, overrides={"local-epochs": 2}, **kwargs)
    assert third[0]["cached"] and not fourth[0]["cached"]
    out = tmp_path / "results" / "tiny"
    for name in ("table.md", "seeds.md", "val_table.md", "results.json", "accuracy.png"):
        assert (out / name).is_file(), name
    assert "| fedavg |" in (out / "table.md").read_text()


def test_worker_processes_run_every_pair_and_fill_the_same_cache(tiny, tmp_path):
    preset = _preset(tmp_path, {**tiny, "local-epochs": 3, "methods": "fedavg"},
                     {**SWEEP, "seeds": [0, 1]})
    kwargs = {"results_root": tmp_path / "results", "cache_dir": tmp_path / "cache"}
    parallel = run_benchmark(preset, workers=2, **kwargs)
    assert [(r["seed"], r["cached"]) for r in parallel] == [(0, False), (1, False)]
    assert len(list((tmp_path / "cache").iterdir())) == 2
    # One process at the workers' thread count reads what they cached; at another
    # count it trains anew (training is bit-identical at a fixed thread count only).
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
        again = run_benchmark(preset, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert all(r["cached"] for r in again)
    for a, b in zip(parallel, again, strict=True):
        assert a["results"]["ensemble"]["accuracy"] == b["results"]["ensemble"]["accuracy"]
    saved = yaml.safe_load((tmp_path / "results" / "tiny" / "results.json").read_text())
    assert [r["seed"] for r in saved["records"]] == [0, 1]


def test_the_cache_key_separates_thread_counts_and_client_settings(tiny):
    cfg = parse_config(tiny)
    assert client_key(cfg, 3, threads=1) == client_key(cfg, 3, threads=1)
    assert client_key(cfg, 3, threads=1) != client_key(cfg, 3, threads=2)
    assert client_key(cfg, 3, threads=1) != client_key(cfg, 4, threads=1)
    assert client_key(cfg, 3, threads=1) == client_key(parse_config({**tiny, "temperature": 2}),
                                                       3, threads=1)
    # Private clients make other uploads; each ε its own.
    eps8, eps4 = (client_key(parse_config({**tiny, "dp-epsilon": e}), 3, threads=1)
                  for e in (8, 4))
    assert len({client_key(cfg, 3, threads=1), eps8, eps4}) == 3


def test_summary_table_gives_mean_and_std_over_seeds():
    records = [{"split": "dir-0.1", "seed": s, "results": {"m": {"accuracy": a}}}
               for s, a in ((0, 0.2), (1, 0.4))]
    table = summary_table(records)
    assert "| m | 30.00 ± 10.00 |" in table
    assert "| method | dir-0.1 |" in table


def test_seed_table_lines_up_every_seed_in_seed_order():
    records = [{"split": "dir-0.1", "seed": s, "results": {"m": {"accuracy": a}, **extra}}
               for s, a, extra in ((1, 0.4, {}), (0, 0.2, {"n": {"accuracy": 0.5}}))]
    table = seed_table(records)
    assert "| method | dir-0.1, seeds 0 / 1 |" in table
    assert "| m | 20.0 / 40.0 |" in table
    assert "| n | 50.0 / - |" in table


def test_seconds_table_gives_mean_wall_and_cpu_seconds_and_marks_what_is_missing():
    records = [{"split": "dir-0.1", "seed": 0,
                "results": {"m": {"seconds": 10.0, "cpu-seconds": 8.0},
                            "old": {"seconds": 5.0}}},
               {"split": "dir-0.1", "seed": 1,
                "results": {"m": {"seconds": 30.0, "cpu-seconds": 12.0}}}]
    table = seconds_table(records)
    assert "| method | dir-0.1 |" in table
    assert "| m | 20 / 10 |" in table
    assert "| old | 5 / - |" in table


def test_lead_table_compares_fedmitr_with_each_baseline_seed_by_seed():
    acc = {0: {"fedmitr": 0.6, "deepinversion": 0.5, "dense": 0.7, "ensemble": 0.8},
           1: {"fedmitr": 0.4, "deepinversion": 0.5, "dense": 0.2, "ensemble": 0.8}}
    records = [{"split": "dir-0.1", "seed": s,
                "results": {m: {"accuracy": a} for m, a in accs.items()}}
               for s, accs in acc.items()]
    table = lead_table(records)
    assert "| fedmitr against | dir-0.1 |" in table
    assert "| deepinversion | +0.00 (1/2) |" in table  # +10 and -10 points
    assert "| dense | +5.00 (1/2) |" in table  # -10 and +20
    # Each seed's best baseline: dense on seed 0 (-10), deepinversion on seed 1 (-10).
    assert "| best baseline | -10.00 (0/2) |" in table
    assert "| fedmitr / ensemble | 62.5 % |" in table
    assert "coboosting" not in table  # a baseline that did not run gets no row


@pytest.mark.parametrize("preset", sorted(p.name for p in SIM_CONFIGS_DIR.glob("*.yaml")))
def test_every_shipped_preset_is_valid(preset):
    """App presets parse; benchmark presets (with a sweep) pass the benchmark's checks too."""
    path = SIM_CONFIGS_DIR / preset
    data = yaml.safe_load(path.read_text())
    cfg = parse_config({"preset": path.stem})
    assert cfg.preset == path.stem
    if "sweep" in data:
        run_config, sweep = load_sweep(path)
        assert sweep["seeds"] and sweep["splits"]
        name = parse_config(run_config).model.pretrained
        if name:  # a timm name, downloaded on users' machines: it must be one timm knows
            import timm

            assert name in timm.list_pretrained(), name


def test_fedavg_rounds_continue_the_cached_round_through_the_client_app(tiny, tmp_path):
    run_config = {**tiny, "local-epochs": 3, "methods": "fedavg,fedavg-rounds", "num-rounds": 3}
    preset = _preset(tmp_path, run_config, SWEEP, name="rounds")
    records = run_benchmark(preset, results_root=tmp_path / "results",
                            cache_dir=tmp_path / "cache")
    results = records[0]["results"]
    rounds = results["fedavg-rounds"]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    # Round 1 is the cached one-shot round: its model is the one-shot FedAvg model.
    assert rounds[0]["accuracy"] == pytest.approx(results["fedavg"]["accuracy"], abs=1e-9)
    assert results["fedavg-rounds"]["accuracy"] == rounds[-1]["accuracy"]
    out = tmp_path / "results" / "rounds"
    assert (out / "rounds.png").is_file()
    assert "| fedavg-rounds |" in (out / "table.md").read_text()
    metrics = out / "runs" / "dir-0.5-seed0" / "metrics.json"
    assert "fedavg-rounds" in metrics.read_text()


def test_append_keeps_earlier_records_of_the_same_run_config(tiny, tmp_path):
    sweep = {**SWEEP, "seeds": [0, 1], "splits": [{"partitioner": "dirichlet", "alpha": 0.5},
                                                  {"partitioner": "iid"}]}
    preset = _preset(tmp_path, {**tiny, "local-epochs": 2, "methods": "fedavg"}, sweep)
    kwargs = {"results_root": tmp_path / "results", "cache_dir": tmp_path / "cache"}
    run_benchmark(preset, seeds=[0, 1], splits=["dir-0.5"], **kwargs)
    both = run_benchmark(preset, seeds=[0], splits=["iid"], append=True, **kwargs)
    assert [(r["split"], r["seed"]) for r in both] == [("dir-0.5", 0), ("dir-0.5", 1),
                                                       ("iid", 0)]
    table = (tmp_path / "results" / "tiny" / "table.md").read_text()
    assert "| method | dir-0.5 (2 seeds) | iid (1 seed) |" in table
    # Without --append the folder holds only the new run; another run config is refused.
    alone = run_benchmark(preset, seeds=[0], splits=["iid"], **kwargs)
    assert [(r["split"], r["seed"]) for r in alone] == [("iid", 0)]
    with pytest.raises(ConfigError, match="'temperature'"):
        run_benchmark(preset, seeds=[0], splits=["iid"], append=True,
                      overrides={"temperature": 2.0}, **kwargs)
    # Settings are compared resolved: naming a default changes nothing...
    default_t = parse_config({}).distill.temperature
    run_benchmark(preset, seeds=[1], splits=["iid"], append=True,
                  overrides={"temperature": default_t}, **kwargs)
    # ...and a folder made under other defaults is refused, read from its runs' config.yaml.
    results = tmp_path / "results" / "tiny" / "results.json"
    saved = json.loads(results.read_text())
    del saved["resolved-config"]
    results.write_text(json.dumps(saved))
    config = tmp_path / "results" / "tiny" / "runs" / "iid-seed0" / "config.yaml"
    config.write_text(config.read_text().replace("hi-weight: ", "hi-weight: 0.9 #"))
    with pytest.raises(ConfigError, match="'hi-weight'"):
        run_benchmark(preset, seeds=[0], splits=["iid"], append=True, **kwargs)
    # A key added to the code after the folder was made matches at its default only.
    lines = config.read_text().replace("hi-weight: 0.9 #", "hi-weight: ").splitlines()
    config.write_text("\n".join(x for x in lines if not x.startswith("keep-ratio:")) + "\n")
    with pytest.raises(ConfigError, match="'keep-ratio'"):
        run_benchmark(preset, seeds=[0], splits=["iid"], append=True,
                      overrides={"keep-ratio": 0.9}, **kwargs)
    run_benchmark(preset, seeds=[0], splits=["iid"], append=True, **kwargs)


def test_append_adds_a_method_on_the_same_uploads_and_refuses_other_uploads(tiny, tmp_path):
    preset = _preset(tmp_path, {**tiny, "local-epochs": 2, "methods": "deepinversion"}, SWEEP)
    kwargs = {"results_root": tmp_path / "results", "cache_dir": tmp_path / "cache"}
    first = run_benchmark(preset, **kwargs)[0]
    digest = first["uploads-digest"]
    assert digest == uploads_digest(next((tmp_path / "cache").iterdir()))
    added = run_benchmark(preset, overrides={"methods": "fedavg"}, append=True,
                          variants={"uniform": {"weighting": "uniform"}}, **kwargs)
    # One record per pair: the DeepInversion row of the first run is kept beside the
    # second's; the upload-only rows did not move.
    assert len(added) == 1 and added[0]["uploads-digest"] == digest
    assert added[0]["results"]["deepinversion"] == first["results"]["deepinversion"]
    for row in ("ensemble", "fedavg"):
        assert added[0]["results"][row]["accuracy"] == first["results"][row]["accuracy"]
    table = (tmp_path / "results" / "tiny" / "table.md").read_text()
    assert "| deepinversion |" in table and "| fedavg |" in table
    results = tmp_path / "results" / "tiny" / "results.json"
    # The first run's folder is left as it was; the record names every folder, keeps
    # how the uploads were made, and the table's run config names every method run.
    runs = tmp_path / "results" / "tiny" / "runs"
    assert "deepinversion" in json.loads((runs / "dir-0.5-seed0" / "metrics.json").read_text(
        ))["results"]
    assert added[0]["run-folders"] == ["dir-0.5-seed0", "dir-0.5-seed0-run2",
                                       "dir-0.5-seed0-uniform"]
    assert "fedavg" in (runs / "dir-0.5-seed0-run2" / "metrics.json").read_text()
    assert (added[0]["cached"], added[0]["client-seconds"]) == (False, first["client-seconds"])
    assert json.loads(results.read_text())["run-config"]["methods"] == "deepinversion,fedavg"
    # A later append without variants keeps their rows and what they were, unrun.
    variant_run = runs / "dir-0.5-seed0-uniform"
    (variant_run / "metrics.json").unlink()
    again = run_benchmark(preset, overrides={"methods": "fedavg"}, append=True, **kwargs)
    assert "fedavg (uniform)" in again[0]["results"]
    assert json.loads(results.read_text())["variants"] == {"uniform": {"weighting": "uniform"}}
    assert not (variant_run / "metrics.json").exists()
    # A label already in the table cannot be given another setting.
    with pytest.raises(ConfigError, match="'uniform'.*another label"):
        run_benchmark(preset, overrides={"methods": "fedavg"}, append=True,
                      variants={"uniform": {"weighting": "samples"}}, **kwargs)

    def tamper(change) -> None:
        saved = json.loads(results.read_text())
        change(saved["records"][0])
        results.write_text(json.dumps(saved))

    tamper(lambda r: r.update({"uploads-digest": "0" * 16}))
    with pytest.raises(ConfigError, match="dir-0.5-seed0 ran on other uploads"):
        run_benchmark(preset, overrides={"methods": "fedavg"}, append=True, **kwargs)
    # A record from before digests were kept is compared by its upload-only rows.
    tamper(lambda r: r.pop("uploads-digest"))
    kept = run_benchmark(preset, overrides={"methods": "fedavg"}, append=True, **kwargs)[0]
    assert "deepinversion" in kept["results"] and kept["uploads-digest"] == digest
    tamper(lambda r: (r.pop("uploads-digest"), r["results"]["ensemble"].update(accuracy=0.0)))
    with pytest.raises(ConfigError, match="other uploads"):
        run_benchmark(preset, overrides={"methods": "fedavg"}, append=True, **kwargs)


def test_a_variant_label_run_again_covers_both_runs_methods_and_keeps_its_setting():
    saved = {"no prior": {"feature-stats": False, "methods": "fedmitr"}}
    merged = merge_variants(saved, {"no prior": {"feature-stats": False,
                                                 "methods": "deepinversion,fedmitr"}})
    assert merged == {"no prior": {"feature-stats": False,
                                   "methods": "fedmitr,deepinversion"}}
    assert merge_variants(saved, {"late": {"prune-at": "0.6"}}) == {
        **saved, "late": {"prune-at": "0.6"}}
    # A variant naming no methods ran the run's own.
    assert merge_variants(saved, {"no prior": {"feature-stats": False}}, "fedftg")[
        "no prior"]["methods"] == "fedmitr,fedftg"
    with pytest.raises(ConfigError, match="'no prior'"):
        merge_variants(saved, {"no prior": {"feature-stats": True, "methods": "fedmitr"}})


def test_a_variant_reruns_the_server_on_the_same_uploads_as_extra_rows(tiny, tmp_path):
    preset = _preset(tmp_path, {**tiny, "local-epochs": 3, "methods": "fedavg"}, SWEEP)
    kwargs = {"results_root": tmp_path / "results", "cache_dir": tmp_path / "cache"}
    records = run_benchmark(preset, variants={"uniform": {"weighting": "uniform"}}, **kwargs)
    results = records[0]["results"]
    # The same uploads: one-shot FedAvg is the same model in the variant.
    assert results["fedavg (uniform)"]["accuracy"] == results["fedavg"]["accuracy"]
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert (tmp_path / "results" / "tiny" / "runs" / "dir-0.5-seed0-uniform" /
            "metrics.json").is_file()
    assert "| fedavg (uniform) |" in (tmp_path / "results" / "tiny" / "table.md").read_text()
    with pytest.raises(ConfigError, match="local-epochs"):
        run_benchmark(preset, variants={"longer": {"local-epochs": 4}}, **kwargs)


def test_split_names_say_the_partition_and_whether_clients_are_private():
    assert split_name({"partitioner": "dirichlet", "alpha": 0.5}) == "dir-0.5"
    assert split_name({"partitioner": "pathological", "classes-per-client": 2}) == "path-2"
    assert split_name({"partitioner": "dirichlet", "alpha": 0.1, "dp-epsilon": 4.0}) == \
        "dir-0.1-eps4"


def test_tables_only_rewrites_the_tables_from_results_json(tmp_path):
    preset = tmp_path / "tiny.yaml"
    out = tmp_path / "results" / "tiny-t1"
    argv = [str(preset), "--tag", "t1", "--results-root", str(tmp_path / "results"),
            "--tables-only"]
    with pytest.raises(ConfigError, match="results.json not found"):
        main(argv)
    out.mkdir(parents=True)
    records = [{"split": "dir-0.1", "seed": s,
                "results": {"m": {"accuracy": a, "val-accuracy": a / 2}}}
               for s, a in ((0, 0.2), (1, 0.4))]
    (out / "results.json").write_text(json.dumps({"records": records}))
    main(argv)
    assert "| m | 30.00 ± 10.00 |" in (out / "table.md").read_text()
    assert "| m | 20.0 / 40.0 |" in (out / "seeds.md").read_text()
    assert "| m | 15.00 ± 5.00 |" in (out / "val_table.md").read_text()
    assert "| m | - / - |" in (out / "seconds.md").read_text()  # these records have no time
    assert not (out / "leads.md").exists()  # no fedmitr to compare
    assert not (out / "runs").exists()  # nothing ran
