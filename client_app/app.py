"""ClientApp: load this node's data, train the local ViT, reply once.

Simulated SuperNodes get ``partition-id`` / ``num-partitions`` from Flower and
train on that partition of the run's dataset. A deployed SuperNode is started
with ``--node-config "data-path=..."`` and trains on its own files, prepared as
the server's train message describes (``fedmitr_core.local_data``).

The reply holds the weights (ArrayRecord ``arrays``), the counts and metrics
(MetricRecord ``metrics``) and, unless ``client-stats`` is false in the run
config or in this node's config, the trained model's token statistics over the
node's training images (ArrayRecord ``token-stats``: ``mean`` and ``var``,
``(depth + 1, D)`` each; metric ``token-stats-images``). A private client
(``dp-epsilon`` or ``dp-noise-multiplier``, in the run config or this node's)
trains with DP-SGD, releases noisy counts and statistics, and reports the ε it
spent (metrics ``dp-epsilon``, ``dp-delta``, ``dp-noise-multiplier``, ``dp-steps``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedmitr_core.client.training import client_partition, client_seed, train_client
from fedmitr_core.config import DataConfig, FedMITRConfig, parse_config
from fedmitr_core.data.datasets import DatasetSplits, DataSpec, Split, load_dataset
from fedmitr_core.data.local import load_local_data
from fedmitr_core.data.partition import partition_indices

app = ClientApp()


@lru_cache(maxsize=2)
def _dataset(cfg: DataConfig, seed: int) -> DatasetSplits:
    return load_dataset(cfg, seed)


def _node_partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node config key {err} is missing: a simulated SuperNode gets 'partition-id' "
            "and 'num-partitions' from Flower; a deployed one needs them in --node-config"
        ) from err


@lru_cache(maxsize=2)
def _partitions(cfg: FedMITRConfig, num_partitions: int) -> tuple[np.ndarray, ...]:
    # One Ray worker serves many simulated clients: draw the split once per run.
    labels = _dataset(cfg.data, cfg.seed).train.labels.numpy()
    return tuple(partition_indices(labels, cfg.partition, num_partitions, cfg.seed))


@lru_cache(maxsize=2)
def _local_data(path: str, spec: DataSpec) -> Split:
    return load_local_data(path, spec)


def _server_spec(msg: Message) -> DataSpec:
    records = [r for r in msg.content.config_records.values() if "num-classes" in r]
    return DataSpec.from_record(records[0] if records else {})


def _round_number(msg: Message) -> int:
    for record in msg.content.config_records.values():
        if "server-round" in record:
            return int(record["server-round"]) + int(record.get("round-offset", 0))
    return 1


def _with_node_privacy(context: Context) -> dict:
    """The run config with this node's ``dp-*`` keys (a site's own privacy) over it."""
    own = {k: v for k, v in context.node_config.items() if str(k).startswith("dp-")}
    return {**context.run_config, **own}


def _share_stats(context: Context, cfg: FedMITRConfig) -> bool:
    """``client-stats`` of this node's config if set there, else of the run config."""
    value = context.node_config.get("client-stats", cfg.client.client_stats)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, bool):
        return value
    raise ValueError(f"node config key 'client-stats': expected true or false, got {value!r}")


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train from the server's initial weights; reply with weights + label counts."""
    cfg = parse_config(_with_node_privacy(context))
    data_path = context.node_config.get("data-path")
    ids: dict[str, int] = {}
    if data_path:
        spec = _server_spec(msg)
        data = _local_data(str(data_path), spec)
        client = int(context.node_id) % 1000
    else:
        partition_id, num_partitions = _node_partition(context)
        splits = _dataset(cfg.data, cfg.seed)
        spec = splits.spec
        data = client_partition(cfg, splits, partition_id, num_partitions,
                                _partitions(cfg, num_partitions))
        client = partition_id
        ids = {"partition-id": partition_id, "num-partitions": num_partitions}
    server_round = _round_number(msg)
    initial = msg.content.array_records[next(iter(msg.content.array_records))]
    # Statistics serve the one-shot round's inversion; later rounds (fedavg-rounds,
    # Flower's FedAvg, which takes one ArrayRecord per reply) never send them.
    update = train_client(cfg, data, spec, initial.to_torch_state_dict(),
                          seed=client_seed(cfg.seed, client, server_round),
                          share_stats=server_round == 1 and _share_stats(context, cfg))
    acc = update.metrics["local-train-accuracy"]
    metrics = MetricRecord({
        "num-examples": update.num_examples,
        "label-counts": [int(v) for v in update.label_counts],
        "local-train-accuracy": 0.0 if acc != acc else float(acc),
        **{k: v for k, v in update.metrics.items() if k.startswith("dp-")},
        **ids,
    })
    content = RecordDict({"arrays": ArrayRecord(update.state), "metrics": metrics})
    if update.token_stats is not None:
        metrics["token-stats-images"] = update.token_stats.num_images
        content["token-stats"] = ArrayRecord(
            {k: torch.from_numpy(v) for k, v in update.token_stats.arrays().items()})
    return Message(content=content, reply_to=msg)
