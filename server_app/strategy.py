"""One-shot strategy: one round of FedAvg's sampling, FedMITR's aggregation."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedmitr_core.client.training import initial_model_load
from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data.datasets import DatasetSplits
from fedmitr_core.server.pipeline import ServerOutcome, run_pipeline
from fedmitr_core.server.reports import write_config
from fedmitr_core.server.uploads import UploadIntake, partition_client_id


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


class MethodsFailedError(RuntimeError):
    """Every server method failed: there is no global model."""


class OneShotStrategy(FedAvg):
    """Sample every connected node once, then distil instead of averaging.

    Each reply is validated and, if good, persisted to ``<run_dir>/uploads/`` the
    moment it arrives (``fedmitr_core.server.uploads.UploadIntake``);
    ``aggregate_train`` then runs the server pipeline on them
    (``fedmitr_core.server.pipeline``).
    """

    def __init__(self, cfg: FedMITRConfig, data: DatasetSplits, run_dir: Path) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0,
                         min_train_nodes=max(1, cfg.server.min_clients),
                         min_available_nodes=max(1, cfg.server.min_clients))
        self.cfg, self.data, self.run_dir = cfg, data, run_dir
        model, self.pretrained = initial_model_load(cfg, data.spec)
        self.initial_state: dict[str, torch.Tensor] = model.state_dict()
        self.intake = UploadIntake(run_dir, self.initial_state, data.spec.num_classes,
                                   cfg.server.max_weight_ratio)
        self.outcome: ServerOutcome | None = None
        self.sampled_nodes: set[int] = set()
        self._handled: set[int] = set()  # id() of the replies taken in (alive all round)
        self._replied: set[int] = set()
        self._partitions: set[int] = set()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """FedAvg's sampling; remembers which nodes were asked, to name the silent ones."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.sampled_nodes = {int(m.metadata.dst_node_id) for m in messages}
        return messages

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 1,
              timeout: float = 3600, **kwargs: Any) -> Result:
        """FedAvg's ``start``, on a grid that hands over each reply as it arrives.

        The resolved config and an open upload report are written first, so the
        run folder can be resumed whatever happens once replies come in.
        """
        write_config(self.run_dir, self.cfg.to_flat())
        log(INFO, self.pretrained.summary())
        self.intake.write_report(round="open", pretrained=self.pretrained.record())
        return super().start(ArrivalGrid(grid, self.accept_reply), initial_arrays,
                             num_rounds=num_rounds, timeout=timeout, **kwargs)

    def accept_reply(self, msg: Message, node: int | None = None) -> None:
        """Take in one reply from ``node``: validated and, if good, persisted at once.

        Nothing in a reply can raise out of here: what cannot be read is rejected.
        """
        if id(msg) in self._handled:
            return
        self._handled.add(id(msg))
        node = int(msg.metadata.src_node_id) if node is None else int(node)
        self._replied.add(node)
        client_id = f"node-{node}"
        try:
            if msg.has_error():
                self.intake.fail(node, str(msg.error.reason))
                log(WARNING, "client node %d failed: %s", node,
                    self.intake.failed[-1]["reason"])
                return
            client_id, problems = self._take(msg, node)
        except Exception as err:  # noqa: BLE001 - one client's reply never stops the server
            problems = [f"reply could not be read: {err!r}"]
            self.intake.reject(client_id, problems, node)
        if problems:
            log(WARNING, "rejected upload from %s: %s", client_id,
                "; ".join(self.intake.rejected[-1]["reasons"]))

    def _take(self, msg: Message, node: int) -> tuple[str, list[str]]:
        """The client id of ``msg`` and the reasons it was rejected (none: persisted)."""
        metrics, problems = _metrics(msg)
        partition = metrics.get("partition-id")
        num_partitions = metrics.get("num-partitions")
        if _whole(num_partitions) and 0 < num_partitions <= MAX_PARTITIONS:
            self._partitions.add(int(num_partitions))
        client_id = (partition_client_id(int(partition), node)
                     if _whole(partition) and 0 <= partition < MAX_PARTITIONS else f"node-{node}")
        if not problems:
            problems = _check_size(_weights_record(msg), self.intake.size_limit)
        if not problems:
            arrays, problems = _arrays(_weights_record(msg))
        if problems:
            self.intake.reject(client_id, problems, node)
            return client_id, problems
        stats, refusal = self._token_stats(msg)
        return client_id, self.intake.take(client_id, arrays, metrics, node,
                                           token_stats=stats, stats_refusal=refusal)

    def _token_stats(self, msg: Message) -> tuple[dict[str, Any] | None, str]:
        """The reply's token statistics (None if not sent), and why they were refused.

        Too large a record is refused before it is decoded; the weights are
        still taken either way.
        """
        record = msg.content.array_records.get(STATS_RECORD)
        if record is None:
            return None, ""
        problems = _check_size(record, self.intake.stats_size_limit)
        if not problems:
            arrays, problems = _arrays(record)
        return (None, "; ".join(problems)) if problems else (arrays, "")

    def receive_uploads(self, replies: Iterable[Message]) -> dict[str, Any]:
        """Take in every reply not seen yet; write and return the account of all of them."""
        for msg in replies:
            self.accept_reply(msg)
        # Nodes asked to train whose reply never came (timed out or lost on the way).
        for node in sorted(self.sampled_nodes - self._replied):
            self.intake.fail(node, "no reply before 'round-timeout'")
            self._replied.add(node)
            log(WARNING, "client node %d sent no reply before the round timeout", node)
        expected = max(self._partitions) if self._partitions else None
        report = self.intake.write_report(**{"num-partitions": expected, "round": "closed"})
        accepted = len(report["accepted"])
        log(INFO, "uploads: %d accepted, %d rejected, %d failed or silent; persisted to %s",
            accepted, len(report["rejected"]), len(report["failed"]), self.intake.folder)
        if expected is not None and accepted < expected:
            log(WARNING, "only %d of %d partitions are in the teacher set: the global model "
                "is built from part of the data (start as many SuperNodes as partitions, "
                "e.g. --federation-config \"num-supernodes=%d\")", accepted, expected, expected)
        return report

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Persist the uploads, then run the server pipeline on them."""
        report = self.receive_uploads(replies)
        needed = max(1, self.cfg.server.min_clients)
        if len(report["accepted"]) < needed:
            raise InsufficientUploadsError(
                f"{len(report['accepted'])} valid uploads, but run config key 'min-clients' "
                f"asks for at least {needed}; accepted uploads are kept in {self.intake.folder}")
        self.outcome = run_pipeline(self.cfg, self.data, self.run_dir, emit=emit_log)
        if self.outcome.global_model is None:
            raise MethodsFailedError(
                f"every method failed (see 'results' in {self.run_dir / 'metrics.json'}); "
                "no global model was saved")
        metrics = MetricRecord({f"{name}-accuracy": float(r["accuracy"])
                                for name, r in self.outcome.results.items()
                                if r.get("accuracy") is not None})
        return ArrayRecord(self.outcome.global_model.state_dict()), metrics


MAX_PARTITIONS = 10**6


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


STATS_RECORD = "token-stats"


def _metrics(msg: Message) -> tuple[dict[str, Any], list[str]]:
    """A reply's metrics, and why the reply cannot be read if it cannot.

    A reply holds one MetricRecord and the weights' ArrayRecord, and may add
    the ArrayRecord ``token-stats``.
    """
    content = msg.content
    weights = [k for k in content.array_records if k != STATS_RECORD]
    if len(weights) != 1 or len(content.metric_records) != 1:
        return {}, ["reply must hold exactly one MetricRecord and one ArrayRecord of weights "
                    f"(and optionally the ArrayRecord '{STATS_RECORD}')"]
    return dict(next(iter(content.metric_records.values()))), []


def _weights_record(msg: Message) -> ArrayRecord:
    return next(v for k, v in msg.content.array_records.items() if k != STATS_RECORD)


def _check_size(record: ArrayRecord, limit: int) -> list[str]:
    """Refuse a record whose arrays hold more than ``limit`` bytes, before decoding them."""
    size = sum(len(array.data) for array in record.values())
    # Each array's serialised bytes carry a small header besides the values.
    allowance = limit + 1024 * len(record)
    return [] if size <= allowance else [
        f"upload of {size} bytes exceeds the limit of {allowance} bytes (not decoded)"]


def _arrays(record: ArrayRecord) -> tuple[dict[str, Any], list[str]]:
    """A record's arrays as plain numpy arrays, and why they cannot be decoded if not."""
    try:
        return {k: v.numpy() for k, v in record.items()}, []
    except Exception as err:  # noqa: BLE001 - any undecodable array is a rejection
        return {}, [f"arrays could not be decoded as plain numpy arrays: {err!r}"]
