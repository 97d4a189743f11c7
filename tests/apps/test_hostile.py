"""Hostile clients: the real ClientApp wrapped by an attacker, against the real Strategy.

Each attacker lets the project's own train handler run, then corrupts its reply
(``InProcessGrid``'s ``tamper``), as an outsider with a modified ClientApp would.
"""

import json

import flwr.app
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedmitr_core.config import parse_config
from fedmitr_core.models.vit import build_vit
from server_app.in_process_grid import InProcessGrid
from server_app.strategy import MethodsFailedError, OneShotStrategy

NODES = 5  # node 1 attacks, four stay honest
ATTACKER = 1


def _state(reply: Message) -> dict:
    return reply.content.array_records["arrays"].to_torch_state_dict()


def _metrics(reply: Message) -> dict:
    return dict(reply.content.metric_records["metrics"])


def _reply(reply: Message, state: dict, metrics: dict, **extra_arrays) -> Message:
    content = RecordDict({"arrays": ArrayRecord({**state, **extra_arrays}),
                          "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=Message(
        content=RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train"))


def _inflated(metrics: dict, factor: int) -> dict:
    """Every class claimed, each count times ``factor`` (the sum kept consistent)."""
    counts = [(int(c) + 1) * factor for c in metrics["label-counts"]]
    return {**metrics, "label-counts": counts, "num-examples": sum(counts)}


def overflow(reply: Message) -> Message:
    """num-examples 2**63 with label-counts [2**63, 0, ...]: consistent, and beyond int64."""
    counts = [2**63] + [0] * 9
    return _reply(reply, _state(reply), {**_metrics(reply), "label-counts": counts,
                                         "num-examples": 2**63})


def huge_weights(reply: Message) -> Message:
    """Every weight 1e30: finite, so a finiteness check alone lets it through."""
    return _reply(reply, {k: torch.full_like(v, 1e30) for k, v in _state(reply).items()},
                  _metrics(reply))


def _random_state() -> dict:
    torch.manual_seed(1234)
    return build_vit("vit-micro", 10, 16, 1, 4).state_dict()


def random_takeover(reply: Message) -> Message:
    """Freshly drawn weights claiming a million times the client's data."""
    return _reply(reply, _random_state(), _inflated(_metrics(reply), 10**6))


def random_weights(reply: Message) -> Message:
    """Freshly drawn weights with the client's true counts: what claims cannot add to."""
    return _reply(reply, _random_state(), _metrics(reply))


def honest_weights_inflated_counts(reply: Message) -> Message:
    """The client's own trained weights, claiming a million times its data."""
    return _reply(reply, _state(reply), _inflated(_metrics(reply), 10**6))


def nan_weights(reply: Message) -> Message:
    """A reply validation rejects: the federation as if the attacker had sent nothing."""
    state = _state(reply)
    state["head.bias"][0] = float("nan")
    return _reply(reply, state, _metrics(reply))


def oversized_stats(reply: Message) -> Message:
    """Honest weights with a 48 MB 'token-stats' record."""
    content = RecordDict({"arrays": ArrayRecord(_state(reply)),
                          "metrics": MetricRecord(_metrics(reply)),
                          "token-stats": ArrayRecord({
                              "mean": torch.zeros(3_000_000, 4), "var": torch.zeros(4)})})
    return Message(content=content, reply_to=Message(
        content=RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train"))


def oversized(reply: Message) -> Message:
    """A valid reply plus a 48 MB array."""
    return _reply(reply, _state(reply), _metrics(reply),
                  padding=torch.zeros(12_000_000, dtype=torch.float32))


_TRAINED: dict[int, RecordDict] = {}


@pytest.fixture(autouse=True)
def clients_train_once(monkeypatch):
    """Every test here runs the same honest clients: train each once, replay its reply."""
    import server_app.in_process_grid as grid_module

    real = grid_module.client_app

    def replaying(msg: Message, context) -> Message:  # noqa: ANN001
        pid = int(context.node_config["partition-id"])
        if pid not in _TRAINED:
            _TRAINED[pid] = real(msg, context).content
        content = _TRAINED[pid]
        return Message(content=RecordDict({
            **{name: ArrayRecord(record.to_torch_state_dict())
               for name, record in content.array_records.items()},
            "metrics": MetricRecord(dict(content.metric_records["metrics"]))}), reply_to=msg)

    monkeypatch.setattr(grid_module, "client_app", replaying)


def _federation(initial_arrays, tiny_run_config, tmp_path, attack=None, name="r", **keys):
    """Run the one round with ``attack`` on node 1; the run folder and its metrics.json."""
    run_config = {**tiny_run_config, "local-epochs": 40, "methods": "fedavg",
                  "output-dir": str(tmp_path), "run-name": name, **keys}
    cfg = parse_config(run_config)
    splits, arrays = initial_arrays(cfg)
    run_dir = tmp_path / name
    seen_before_first_reply = []

    def tamper(pid: int, reply: Message) -> Message:
        # Replies are handled only once pulled: the folder must be resumable by then.
        seen_before_first_reply.append(
            {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set())
        return attack(reply) if attack is not None and pid == ATTACKER else reply

    strategy = OneShotStrategy(cfg, splits, run_dir)
    grid = InProcessGrid(run_config, num_nodes=NODES, tamper=tamper)
    try:
        strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1, timeout=60)
    finally:
        assert all({"config.yaml", "upload_report.json"} <= s for s in seen_before_first_reply)
    return run_dir, json.loads((run_dir / "metrics.json").read_text())


def _reasons(metrics: dict) -> str:
    return " ".join(" ".join(r["reasons"]) for r in metrics["uploads"]["rejected"])


def _accuracies(metrics: dict) -> dict:
    return {k: (v["accuracy"], v["val-accuracy"]) for k, v in metrics["results"].items()}


def test_overflowing_counts_are_rejected_and_the_round_goes_on(initial_arrays, tiny_run_config,
                                                               tmp_path):
    run_dir, metrics = _federation(initial_arrays, tiny_run_config, tmp_path, overflow)
    assert metrics["status"] == "complete"
    assert len(metrics["uploads"]["rejected"]) == 1
    assert "'num-examples' must be a positive integer up to 2**40" in _reasons(metrics)
    assert metrics["num-teachers"] == NODES - 1
    assert (run_dir / "global_model.safetensors").is_file()


def test_huge_finite_weights_are_refused_as_implausible(initial_arrays, tiny_run_config,
                                                        tmp_path):
    _, metrics = _federation(initial_arrays, tiny_run_config, tmp_path, huge_weights)
    assert "max-weight-ratio" in _reasons(metrics)
    assert metrics["num-teachers"] == NODES - 1 and metrics["status"] == "complete"
    assert metrics["results"]["fedavg"]["accuracy"] > 0.15  # chance is 0.10


def test_with_the_bounds_off_a_nan_loss_stops_each_method_and_no_model_is_saved(
        initial_arrays, tiny_run_config, tmp_path):
    with pytest.raises(MethodsFailedError, match="every method failed"):
        _federation(initial_arrays, tiny_run_config, tmp_path, huge_weights,
                    methods="fedmitr,deepinversion", **{"max-weight-ratio": 0,
                                                        "outlier-ratio": 0})
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["global-method"] is None
    for method in ("fedmitr", "deepinversion"):
        assert "inversion step 1 of" in metrics["results"][method]["error"]
        assert metrics["results"][method]["accuracy"] is None
    assert not (tmp_path / "r" / "global_model.safetensors").exists()
    assert "failed" in (tmp_path / "r" / "report.md").read_text()


def test_random_weights_claiming_a_million_times_the_data_take_nothing_over(
        initial_arrays, tiny_run_config, tmp_path):
    _, true_claims = _federation(initial_arrays, tiny_run_config, tmp_path, random_weights,
                                 name="true-claims")
    _, defended = _federation(initial_arrays, tiny_run_config, tmp_path, random_takeover,
                              name="defended")
    _, undefended = _federation(initial_arrays, tiny_run_config, tmp_path, random_takeover,
                                name="undefended", **{"outlier-ratio": 0, "count-cap": 0})
    capped = defended["uploads"]["screening"]["capped"]
    assert len(capped) == 1 and "partition-0001" in capped[0]["client-id"]
    # Undefended, the claim takes the ensemble and FedAvg over: both at chance.
    for ref in ("ensemble", "fedavg"):
        assert undefended["results"][ref]["accuracy"] < 0.2
    # Defended, the ensemble stays within 10 points of the same random model sent with
    # its true counts (measured here: 79.7 % with true counts, 74.7 % with the capped claim).
    ensemble = defended["results"]["ensemble"]["accuracy"]
    assert ensemble > true_claims["results"]["ensemble"]["accuracy"] - 0.10
    assert ensemble > undefended["results"]["ensemble"]["accuracy"] + 0.4


def test_an_inflated_claim_on_honest_weights_is_capped(initial_arrays, tiny_run_config, tmp_path):
    _, metrics = _federation(initial_arrays, tiny_run_config, tmp_path,
                             honest_weights_inflated_counts)
    capped = metrics["uploads"]["screening"]["capped"]
    accepted = {a["client-id"]: a["num-examples"] for a in metrics["uploads"]["accepted"]}
    assert len(capped) == 1 and "partition-0001" in capped[0]["client-id"]
    honest = sorted(n for c, n in accepted.items() if c != capped[0]["client-id"])
    lower_median = sorted([*honest, capped[0]["claimed"]])[(NODES - 1) // 2]
    assert capped[0]["claimed"] == accepted[capped[0]["client-id"]] > 10**6
    assert capped[0]["used"] <= 5 * lower_median  # count-cap's default


@pytest.fixture
def decoded_sizes(monkeypatch):
    """The serialised size of every array the server decodes, in order."""
    sizes = []
    numpy = flwr.app.Array.numpy

    def counting(self):  # noqa: ANN001, ANN202
        sizes.append(len(self.data))
        return numpy(self)

    monkeypatch.setattr(flwr.app.Array, "numpy", counting)
    return sizes


def test_an_oversized_reply_is_refused_before_its_arrays_are_decoded(
        initial_arrays, tiny_run_config, tmp_path, decoded_sizes):
    _, metrics = _federation(initial_arrays, tiny_run_config, tmp_path, oversized)
    assert "exceeds the limit" in _reasons(metrics) and "not decoded" in _reasons(metrics)
    assert decoded_sizes and max(decoded_sizes) < 1_000_000  # the 48 MB array never was
    assert metrics["num-teachers"] == NODES - 1


def test_oversized_statistics_are_refused_undecoded_and_the_weights_kept(
        initial_arrays, tiny_run_config, tmp_path, decoded_sizes):
    _, metrics = _federation(initial_arrays, tiny_run_config, tmp_path, oversized_stats)
    notes = {a["client-id"]: a["token-stats"] for a in metrics["uploads"]["accepted"]}
    attacker = next(c for c in notes if "partition-0001" in c)
    note = notes.pop(attacker)
    assert note.startswith("refused: upload of") and "not decoded" in note
    assert set(notes.values()) == {"accepted"}  # the honest clients' statistics
    assert decoded_sizes and max(decoded_sizes) < 1_000_000  # the 48 MB record never was
    assert metrics["num-teachers"] == NODES  # the attacker's weights are still a teacher
    assert metrics["token-stats"]["without"] == [attacker]


def test_an_honest_federation_scores_the_same_with_the_defence_on(initial_arrays,
                                                                  tiny_run_config, tmp_path):
    _, on = _federation(initial_arrays, tiny_run_config, tmp_path, name="on")
    _, off = _federation(initial_arrays, tiny_run_config, tmp_path, name="off",
                         **{"max-weight-ratio": 0, "outlier-ratio": 0, "count-cap": 0})
    assert on["uploads"]["screening"]["dropped"] == on["uploads"]["screening"]["capped"] == []
    assert on["uploads"]["rejected"] == [] and on["num-teachers"] == NODES
    assert _accuracies(on) == _accuracies(off)
