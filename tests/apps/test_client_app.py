"""The real ClientApp's train handler: weights and label counts in one reply."""

import numpy as np
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


def test_later_rounds_train_with_another_seed(initial_arrays, tiny_run_config):
    cfg = parse_config(tiny_run_config)
    _, arrays = initial_arrays(cfg)
    states = []
    for server_round in (1, 2):
        msg = Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord(
            {"server-round": server_round})}), dst_node_id=7, message_type="train")
        ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config=tiny_run_config)
        states.append(client_app(msg, ctx).content.array_records["arrays"].to_torch_state_dict())
    assert not np.allclose(states[0]["head.weight"].numpy(), states[1]["head.weight"].numpy())
