"""The real Strategy (and ClientApp), driven in-process through a small Grid."""

import json

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedmitr_core.config import parse_config
from server_app.in_process_grid import InProcessGrid
from server_app.strategy import ArrivalGrid, InsufficientUploadsError, OneShotStrategy


def _poison(pid: int, reply: Message) -> Message:
    if pid != 1:
        return reply
    state = reply.content.array_records["arrays"].to_torch_state_dict()
    state["head.weight"][0, 0] = float("nan")
    content = RecordDict({"arrays": ArrayRecord(state),
                          "metrics": reply.content.metric_records["metrics"]})
    return Message(content=content, reply_to=Message(
        content=RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train"))


def test_one_round_rejects_a_bad_upload_keeps_the_others(initial_arrays, tiny_run_config, tmp_path):
    run_config = {**tiny_run_config, "methods": "fedmitr", "output-dir": str(tmp_path),
                  "run-name": "r"}
    cfg = parse_config(run_config)
    splits, arrays = initial_arrays(cfg)
    strategy = OneShotStrategy(cfg, splits, tmp_path / "r")
    grid = InProcessGrid(run_config, num_nodes=3, tamper=_poison)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1, timeout=60)
    assert grid.pulls == 3  # the strategy pulled the replies one by one, as they came

    run_dir = tmp_path / "r"
    uploads = sorted(p.name for p in (run_dir / "uploads").glob("*.safetensors"))
    weights = [u for u in uploads if not u.endswith(".stats.safetensors")]
    assert len(weights) == 2 and not any("partition-0001" in u for u in uploads)
    # Each accepted client's token statistics are persisted beside its weights.
    assert sorted(set(uploads) - set(weights)) == [
        w.replace(".safetensors", ".stats.safetensors") for w in weights]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rejected = metrics["uploads"]["rejected"]
    assert len(rejected) == 1 and "NaN" in rejected[0]["reasons"][0]
    assert metrics["num-teachers"] == 2
    assert metrics["uploads"]["pretrained"] == {"source": "", "loaded": 0, "resampled": {},
                                                "skipped": {}}
    assert metrics["token-stats"]["prior"] and len(metrics["token-stats"]["with"]) == 2
    assert {"fedmitr", "ensemble", "fedavg", "local-mean"} <= set(metrics["results"])
    for r in metrics["results"].values():
        assert 0.0 <= r["accuracy"] <= 1.0 and r["seconds"] >= 0.0 and r["cpu-seconds"] >= 0.0
    assert metrics["results"]["fedmitr"]["cpu-seconds"] > 0.0
    assert "| CPU seconds |" in (run_dir / "report.md").read_text()
    for name in ("global_model.safetensors", "config.yaml", "report.md",
                 "synthetic_grid.png", "label_distribution.png"):
        assert (run_dir / name).is_file(), name
    assert result.arrays is not None
    assert set(result.arrays.to_torch_state_dict()) == set(arrays.to_torch_state_dict())


def test_too_few_valid_uploads_stops_with_a_clear_message(initial_arrays, tiny_run_config,
                                                          tmp_path):
    run_config = {**tiny_run_config, "methods": "fedavg", "min-clients": 3,
                  "output-dir": str(tmp_path), "run-name": "r"}
    cfg = parse_config(run_config)
    splits, arrays = initial_arrays(cfg)
    strategy = OneShotStrategy(cfg, splits, tmp_path / "r")
    grid = InProcessGrid(run_config, num_nodes=3, tamper=_poison)
    with pytest.raises(InsufficientUploadsError, match="min-clients"):
        strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1, timeout=60)
    assert len(list((tmp_path / "r" / "uploads").glob("*.json"))) == 2


def test_each_upload_is_on_disk_as_soon_as_it_arrives(initial_arrays, tiny_run_config, tmp_path):
    run_config = {**tiny_run_config, "local-epochs": 3, "output-dir": str(tmp_path),
                  "run-name": "r"}
    cfg = parse_config(run_config)
    splits, arrays = initial_arrays(cfg)
    strategy = OneShotStrategy(cfg, splits, tmp_path / "r")
    grid = InProcessGrid(run_config, num_nodes=3)
    on_disk_before_next_pull = []
    pull = grid.pull_messages

    def watching_pull(ids):  # noqa: ANN001, ANN202
        on_disk_before_next_pull.append(
            len(list((tmp_path / "r" / "uploads").glob("*.json"))))
        return pull(ids)

    grid.pull_messages = watching_pull
    messages = strategy.configure_train(1, arrays, ConfigRecord(), grid)
    replies = ArrivalGrid(grid, strategy.accept_reply).send_and_receive(messages, timeout=10)
    assert len(replies) == 3
    # Before the 2nd and 3rd pulls, the replies pulled so far were already persisted.
    assert on_disk_before_next_pull == [0, 1, 2]


def test_fedavg_rounds_continue_the_one_shot_round_with_flowers_fedavg(
        initial_arrays, tiny_run_config, tmp_path):
    from server_app.fedavg_rounds import add_fedavg_rounds

    run_config = {**tiny_run_config, "local-epochs": 5, "methods": "fedavg,fedavg-rounds",
                  "num-rounds": 3, "output-dir": str(tmp_path), "run-name": "r"}
    cfg = parse_config(run_config)
    splits, arrays = initial_arrays(cfg)
    strategy = OneShotStrategy(cfg, splits, tmp_path / "r")
    grid = InProcessGrid(run_config, num_nodes=3)
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1, timeout=60)
    lines: list[str] = []
    result = add_fedavg_rounds(grid, cfg, splits, tmp_path / "r", lines.append)

    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    one_shot = metrics["results"]["fedavg"]["accuracy"]
    rounds = metrics["results"]["fedavg-rounds"]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    # Round 1 of FedAvg is the one-shot round: the same model, the same accuracy.
    assert rounds[0]["accuracy"] == pytest.approx(one_shot, abs=1e-9)
    assert result["accuracy"] == rounds[-1]["accuracy"]
    assert (tmp_path / "r" / "fedavg_rounds.png").is_file()
    assert "fedavg-rounds (3 rounds)" in (tmp_path / "r" / "report.md").read_text()
    assert any("after round 3/3" in line for line in lines)


def test_in_process_grid_needs_no_flower_process_around_it(repo_root):
    # The benchmark builds Flower messages outside any Flower process (and without this
    # file's fixture that sets the task identity): the grid must set what Message needs.
    import subprocess
    import sys

    code = ("from flwr.app import Message, RecordDict\n"
            "from server_app.in_process_grid import InProcessGrid\n"
            "InProcessGrid({}, 2)\n"
            "print(Message(content=RecordDict(), dst_node_id=101, message_type='train')"
            ".metadata.dst_node_id)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "101"


def test_a_server_app_that_fails_says_so_in_metrics_json(tmp_path):
    from flwr.app import Context

    from server_app.app import main

    run_config = {"dataset": "imagefolder", "data-dir": str(tmp_path / "missing"),
                  "output-dir": str(tmp_path), "run-name": "r"}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=run_config)
    with pytest.raises(ValueError, match="data-dir"):
        main(InProcessGrid(run_config, num_nodes=1), context)  # fails before any client trains
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "data-dir" in metrics["error"]
