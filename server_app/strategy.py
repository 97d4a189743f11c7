"""One-shot strategy: one round of FedAvg's sampling, FedMITR's aggregation."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data import DatasetSplits
from fedmitr_core.models import vit_factory
from fedmitr_core.offline import UPLOAD_REPORT
from fedmitr_core.server_job import ServerOutcome, run_server_methods
from fedmitr_core.uploads import (
    Upload,
    expected_spec,
    load_teacher_set,
    persist_upload,
    validate_upload,
)


def emit_log(line: str) -> None:
    """Send each line of ``line`` to Flower's log."""
    for part in line.splitlines():
        log(INFO, part)


class ArrivalGrid(Grid):
    """A Grid that hands each reply to ``on_reply`` the moment it is pulled.

    Flower's ``send_and_receive`` returns replies only when all are in or the
    timeout passes; a server that dies meanwhile would lose them. This one
    pushes, then pulls in a loop and passes every reply on as it arrives (the
    strategy validates and persists it), then returns them all as usual.
    ``on_reply`` also gets the node the message was sent to: an error reply the
    SuperLink writes for a node that went offline comes from the SuperLink, not
    from that node. Everything else is delegated to the wrapped grid.
    """

    def __init__(self, grid: Grid, on_reply: Callable[[Message, int], None],
                 poll_seconds: float = 1.0) -> None:
        self.grid, self.on_reply, self.poll_seconds = grid, on_reply, poll_seconds

    def set_run(self, run_id: int) -> None:
        self.grid.set_run(run_id)

    @property
    def run(self) -> Any:  # noqa: D102
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        """Push ``messages``, pull replies until all are in or ``timeout`` passes."""
        messages = list(messages)
        ids = list(self.push_messages(messages))
        destination = {i: int(m.metadata.dst_node_id) for i, m in zip(ids, messages,
                                                                         strict=True)}
        pending = set(ids)
        expected = len(pending)
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending and len(replies) < expected and (end is None or time.monotonic() < end):
            arrived = list(self.pull_messages(pending))
            for msg in arrived:
                reply_to = msg.metadata.reply_to_message_id
                self.on_reply(msg, destination.get(reply_to, int(msg.metadata.src_node_id)))
            replies.extend(arrived)
            pending -= {m.metadata.reply_to_message_id for m in arrived}
            if not arrived:
                time.sleep(self.poll_seconds)
        return replies


class InsufficientUploadsError(RuntimeError):
    """Fewer valid uploads arrived than the run needs."""


class OneShotStrategy(FedAvg):
    """Sample every connected node once, then distil instead of averaging.

    ``aggregate_train`` validates every reply, persists the accepted ones to
    ``<run_dir>/uploads/`` before any long work, loads them back as teachers and
    runs the configured server methods (``fedmitr_core.server_job``).
    """

    def __init__(self, cfg: FedMITRConfig, splits: DatasetSplits, run_dir: Path) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0,
                         min_train_nodes=max(1, cfg.server.min_clients),
                         min_available_nodes=max(1, cfg.server.min_clients))
        self.cfg = cfg
        self.splits = splits
        self.run_dir = run_dir
        self.upload_dir = run_dir / "uploads"
        self.outcome: ServerOutcome | None = None
        self.sampled_nodes: set[int] = set()
        self._new_model = vit_factory(cfg, splits)
        self._spec = expected_spec(self._new_model())
        self._handled: set[int] = set()  # id() of the replies taken in (alive all round)
        self._replied: set[int] = set()
        self._partitions: set[int] = set()
        self._accepted: list[dict[str, Any]] = []
        self._rejected: list[dict[str, Any]] = []
        self._failed: list[dict[str, Any]] = []
        self.upload_report: dict[str, Any] = {}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """FedAvg's sampling; remembers which nodes were asked, to name the silent ones."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.sampled_nodes = {int(m.metadata.dst_node_id) for m in messages}
        return messages

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 1,
              timeout: float = 3600, **kwargs: Any) -> Result:
        """FedAvg's ``start``, on a grid that hands over each reply as it arrives."""
        return super().start(ArrivalGrid(grid, self.accept_reply), initial_arrays,
                             num_rounds=num_rounds, timeout=timeout, **kwargs)

    def accept_reply(self, msg: Message, node: int | None = None) -> None:
        """Validate one reply from ``node`` and, if good, persist it at once (atomically)."""
        if id(msg) in self._handled:
            return
        self._handled.add(id(msg))
        node = int(msg.metadata.src_node_id) if node is None else int(node)
        self._replied.add(node)
        if msg.has_error():
            self._failed.append({"node-id": node, "reason": str(msg.error.reason)})
            log(WARNING, "client node %d failed: %s", node, msg.error.reason)
            return
        content = msg.content
        arrays: dict[str, Any] = {}
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            problems = ["reply must hold exactly one ArrayRecord and one MetricRecord"]
            metrics: dict[str, Any] = {}
        else:
            record = next(iter(content.array_records.values()))
            metrics = dict(next(iter(content.metric_records.values())))
            try:
                arrays = {k: v.numpy() for k, v in record.items()}
            except (ValueError, TypeError) as err:
                arrays = {}
                problems = [f"arrays could not be decoded as plain numpy arrays: {err}"]
            else:
                problems = validate_upload(arrays, metrics, self._spec, self.splits.num_classes)
        partition = metrics.get("partition-id")
        if isinstance(metrics.get("num-partitions"), int):
            self._partitions.add(int(metrics["num-partitions"]))
        client_id = (f"partition-{int(partition):04d}-node-{node}"
                     if isinstance(partition, int) else f"node-{node}")
        if problems:
            self._rejected.append({"client-id": client_id, "node-id": node, "reasons": problems})
            log(WARNING, "rejected upload from %s: %s", client_id, "; ".join(problems))
            return
        persist_upload(self.upload_dir, Upload(
            client_id=client_id, arrays=arrays, num_examples=int(metrics["num-examples"]),
            label_counts=np.asarray(metrics["label-counts"], dtype=np.int64),
            metrics=metrics))
        self._accepted.append({"client-id": client_id, "node-id": node,
                               "num-examples": int(metrics["num-examples"])})

    def receive_uploads(self, replies: Iterable[Message]) -> dict[str, Any]:
        """Take in every reply not seen yet; return what was accepted, rejected, missing."""
        for msg in replies:
            self.accept_reply(msg)
        accepted, rejected, failed = self._accepted, self._rejected, list(self._failed)
        # Nodes asked to train whose reply never came (timed out or lost on the way).
        for node in sorted(self.sampled_nodes - self._replied):
            failed.append({"node-id": node, "reason": "no reply before 'round-timeout'"})
            log(WARNING, "client node %d sent no reply before the round timeout", node)
        expected = max(self._partitions) if self._partitions else None
        report = {"accepted": accepted, "rejected": rejected, "failed": failed,
                  "num-partitions": expected}
        log(INFO, "uploads: %d accepted, %d rejected, %d failed or silent; persisted to %s",
            len(accepted), len(rejected), len(failed), self.upload_dir)
        if expected is not None and len(accepted) < expected:
            log(WARNING, "only %d of %d partitions are in the teacher set: the global model "
                "is built from part of the data (start as many SuperNodes as partitions, "
                "e.g. --federation-config \"num-supernodes=%d\")",
                len(accepted), expected, expected)
        return report

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Persist the uploads, then run the server methods on them."""
        report = self.receive_uploads(replies)
        self.upload_report = report
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / UPLOAD_REPORT).write_text(json.dumps(report, indent=1),
                                                  encoding="utf-8")
        needed = max(1, self.cfg.server.min_clients)
        if len(report["accepted"]) < needed:
            raise InsufficientUploadsError(
                f"{len(report['accepted'])} valid uploads, but run config key 'min-clients' "
                f"asks for at least {needed}; accepted uploads are kept in {self.upload_dir}")
        teachers = load_teacher_set(self.upload_dir, self._new_model)
        self.outcome = run_server_methods(teachers, self.cfg, self.splits, self.run_dir,
                                          emit=emit_log, upload_report=report)
        metrics = MetricRecord({f"{name}-accuracy": float(r["accuracy"])
                                for name, r in self.outcome.results.items()})
        return ArrayRecord(self.outcome.global_model.state_dict()), metrics
