"""Faults: every kind of bad upload, silent and failing clients, fed to the real Strategy."""

import json

import torch
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict

from fedmitr_core.config import parse_config
from fedmitr_core.models.vit import build_vit
from server_app.in_process_grid import InProcessGrid
from server_app.strategy import OneShotStrategy


def _state(reply: Message) -> dict:
    return reply.content.array_records["arrays"].to_torch_state_dict()


def _metrics(reply: Message) -> dict:
    return dict(reply.content.metric_records["metrics"])


def _with(reply: Message, state: dict | None = None, metrics: dict | None = None) -> Message:
    content = RecordDict({
        "arrays": ArrayRecord(state if state is not None else _state(reply)),
        "metrics": MetricRecord(metrics if metrics is not None else _metrics(reply)),
    })
    return Message(content=content, reply_to=Message(
        content=RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train"))


def _set(state: dict, name: str, value: torch.Tensor) -> dict:
    return {**state, name: value}


# partition id -> (how its reply is altered, what the rejection reason must say)
BAD = {
    1: (lambda r: _with(r, _set(_state(r), "head.weight",
                                _state(r)["head.weight"].index_fill(1, torch.tensor([0]),
                                                                    float("nan")))), "NaN"),
    2: (lambda r: _with(r, _set(_state(r), "head.bias", torch.full((10,), float("inf")))),
        "Inf"),
    3: (lambda r: _with(r, {k: v for k, v in _state(r).items() if k != "head.bias"}),
        "missing arrays"),
    4: (lambda r: _with(r, _set(_state(r), "backdoor.weight", torch.zeros(3))),
        "unexpected arrays"),
    5: (lambda r: _with(r, _set(_state(r), "head.weight", torch.zeros(10, 47))), "shape"),
    6: (lambda r: _with(r, _set(_state(r), "head.weight",
                                _state(r)["head.weight"].double())), "dtype"),
    7: (lambda r: _with(r, build_vit("vit-micro", 10, 16, 1, 8).state_dict()), "shape"),
    8: (lambda r: _with(r, _set(_state(r), "head.weight", torch.zeros(10, 48)) |
                        {"padding": torch.zeros(2_000_000)}), "exceeds the limit"),
    9: (lambda r: _with(r, metrics={k: v for k, v in _metrics(r).items()
                                    if k != "num-examples"}), "num-examples"),
    10: (lambda r: _with(r, metrics={**_metrics(r), "num-examples": -5}), "num-examples"),
    11: (lambda r: _with(r, metrics={**_metrics(r), "label-counts": [-1] + [0] * 9}),
         "non-negative"),
    12: (lambda r: _with(r, metrics={**_metrics(r),
                                     "label-counts": [int(v) + 1 for v in
                                                      _metrics(r)["label-counts"]]}),
         "sums to"),
    13: (lambda r: _with(r, metrics={k: v for k, v in _metrics(r).items()
                                     if k != "label-counts"}), "'label-counts' is missing"),
}
FAILS, SILENT, OFFLINE = 14, 15, 16
NODES = 18  # partitions 0 and 17 stay good
SUPERLINK_NODE_ID = 1


def _written_by_superlink(reply: Message) -> Message:
    """The error reply a SuperLink writes for a node that went offline mid-round."""
    err = Message(Error(code=5, reason="Error: Node Unavailable"), reply_to=Message(
        content=RecordDict(), dst_node_id=SUPERLINK_NODE_ID, message_type="train"))
    err.metadata.__dict__["_reply_to_message_id"] = reply.metadata.reply_to_message_id
    return err


def _tamper(pid: int, reply: Message) -> Message | None:
    if pid in BAD:
        return BAD[pid][0](reply)
    if pid == FAILS:
        return Message(Error(code=0, reason="client crashed: out of memory"), reply_to=Message(
            content=RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train"))
    if pid == SILENT:
        return None  # never arrives: timed out
    if pid == OFFLINE:
        return _written_by_superlink(reply)
    return reply


def test_every_bad_upload_is_rejected_with_its_reason_and_the_run_goes_on(
        initial_arrays, tiny_run_config, tmp_path):
    run_config = {**tiny_run_config, "local-epochs": 5, "methods": "fedavg",
                  "output-dir": str(tmp_path), "run-name": "r"}
    cfg = parse_config(run_config)
    splits, arrays = initial_arrays(cfg)
    strategy = OneShotStrategy(cfg, splits, tmp_path / "r")
    grid = InProcessGrid(run_config, num_nodes=NODES, tamper=_tamper)
    # The silent node holds the round until the timeout; the others are in by then.
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1, timeout=3)

    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    uploads = metrics["uploads"]
    accepted = sorted(a["client-id"].split("-node")[0] for a in uploads["accepted"])
    assert accepted == ["partition-0000", "partition-0017"]
    rejected = {int(r["client-id"].split("-")[1]): " ".join(r["reasons"])
                for r in uploads["rejected"]}
    assert sorted(rejected) == sorted(BAD)
    for pid, (_, reason) in BAD.items():
        assert reason in rejected[pid], (pid, rejected[pid])
    failed = {f["node-id"]: f["reason"] for f in uploads["failed"]}
    assert "out of memory" in failed[grid.nodes[FAILS]]
    assert "round-timeout" in failed[grid.nodes[SILENT]]
    # The SuperLink's reply for the offline node is booked to that node, not the SuperLink.
    assert "Node Unavailable" in failed[grid.nodes[OFFLINE]]
    assert SUPERLINK_NODE_ID not in failed and len(failed) == 3
    assert metrics["num-teachers"] == 2
    # The seed and the library versions are recorded beside the figures.
    assert metrics["seed"] == cfg.seed
    assert {"python", "torch", "timm", "numpy"} <= set(metrics["versions"])
    # Only the accepted uploads reached the disk, and nothing there is a pickle.
    files = sorted(p.name for p in (tmp_path / "r" / "uploads").iterdir())
    # Per accepted upload: weights, token statistics, metadata.
    assert len(files) == 6 and all(f.endswith((".safetensors", ".json")) for f in files)
    assert sum(f.endswith(".stats.safetensors") for f in files) == 2
    assert 0.0 <= metrics["results"]["fedavg"]["accuracy"] <= 1.0
