"""ClientApp: load this node's partition, train the local ViT, reply once."""

from __future__ import annotations

from functools import lru_cache

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedmitr_core.client_job import client_partition, train_client
from fedmitr_core.config import DataConfig, parse_config
from fedmitr_core.data import DatasetSplits, load_dataset

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


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train from the server's initial weights; reply with weights + label counts."""
    cfg = parse_config(context.run_config)
    partition_id, num_partitions = _node_partition(context)
    splits = _dataset(cfg.data, cfg.seed)
    data = client_partition(cfg, splits, partition_id, num_partitions)
    initial = msg.content.array_records[next(iter(msg.content.array_records))]
    update = train_client(cfg, data, splits.num_classes, initial.to_torch_state_dict(),
                          seed=cfg.seed * 1000 + partition_id, image_size=splits.image_size,
                          in_chans=splits.in_chans)
    acc = update.metrics["local-train-accuracy"]
    metrics = MetricRecord({
        "num-examples": update.num_examples,
        "label-counts": [int(v) for v in update.label_counts],
        "local-train-accuracy": 0.0 if acc != acc else float(acc),
        "partition-id": partition_id,
        "num-partitions": num_partitions,
    })
    content = RecordDict({"arrays": ArrayRecord(update.state), "metrics": metrics})
    return Message(content=content, reply_to=msg)
