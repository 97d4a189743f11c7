"""The real ClientApp's train handler: weights and label counts in one reply."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from client_app.app import app as client_app
from fedmitr_core.config import parse_config


def test_client_train_handler_replies_with_weights_and_label_counts(initial_arrays,
                                                                    tiny_run_config):
    cfg = parse_config(tiny_run_config)
    splits, arrays = initial_arrays(cfg)
    msg = Message(content=RecordDict({"arrays": arrays}), dst_node_id=7, message_type="train")
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 2, "num-partitions": 4},
                  state=RecordDict(), run_config=tiny_run_config)
    reply = client_app(msg, ctx)
    assert not reply.has_error()
    metrics = reply.content.metric_records["metrics"]
    counts = np.asarray(metrics["label-counts"])
    assert counts.shape == (10,) and counts.sum() == metrics["num-examples"] > 0
    assert metrics["partition-id"] == 2 and metrics["num-partitions"] == 4
    state = reply.content.array_records["arrays"].to_torch_state_dict()
    before = arrays.to_torch_state_dict()
    assert set(state) == set(before)
    assert any(not np.allclose(state[k].numpy(), before[k].numpy()) for k in state)
    # The trained model's token statistics over the node's images ride along.
    stats = reply.content.array_records["token-stats"].to_numpy_ndarrays()
    assert [a.shape for a in stats] == [(4, 48), (4, 48)]  # mean, var; 3 blocks + embedding
    assert (stats[1] >= 0).all() and metrics["token-stats-images"] == metrics["num-examples"]


@pytest.mark.parametrize(("run_value", "node_value", "shared"), [
    (True, "false", False), (False, None, False), (False, "true", True)])
def test_client_stats_is_settable_per_run_and_per_node(initial_arrays, tiny_run_config,
                                                       run_value, node_value, shared):
    run_config = {**tiny_run_config, "client-stats": run_value, "local-epochs": 1}
    _, arrays = initial_arrays(parse_config(run_config))
    node_config = {"partition-id": 0, "num-partitions": 4}
    if node_value is not None:
        node_config["client-stats"] = node_value
    msg = Message(content=RecordDict({"arrays": arrays}), dst_node_id=7, message_type="train")
    ctx = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(),
                  run_config=run_config)
    reply = client_app(msg, ctx)
    assert ("token-stats" in reply.content.array_records) is shared
    assert ("token-stats-images" in reply.content.metric_records["metrics"]) is shared


def test_later_rounds_train_with_another_seed(initial_arrays, tiny_run_config):
    cfg = parse_config(tiny_run_config)
    _, arrays = initial_arrays(cfg)
    states = []
    for server_round in (1, 2):
        msg = Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord(
            {"server-round": server_round})}), dst_node_id=7, message_type="train")
        ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config=tiny_run_config)
        reply = client_app(msg, ctx)
        states.append(reply.content.array_records["arrays"].to_torch_state_dict())
        # Statistics serve the one-shot round only (FedAvg takes one ArrayRecord).
        assert ("token-stats" in reply.content.array_records) is (server_round == 1)
    assert not np.allclose(states[0]["head.weight"].numpy(), states[1]["head.weight"].numpy())
