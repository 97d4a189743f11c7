"""A Flower Grid that delivers each message to the real ClientApp in this process.

The accuracy benchmark uses it to run ``fedavg-rounds`` (Flower's own FedAvg
strategy, the app's own ClientApp) on simulated partitions without starting a
SuperLink; the tests use it to drive the Strategy's round in-process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from client_app.app import app as client_app

Tamper = Callable[[int, Message], Message | None]


class InProcessGrid(Grid):
    """Runs every node's ClientApp when messages are pushed; replies wait to be pulled.

    Parameters
    ----------
    run_config
        The run config every node's ClientApp receives (flat run-config keys).
    num_nodes
        Simulated SuperNodes; node ``i`` trains partition ``i`` of ``num_nodes``.
    tamper
        Optional change to each reply (``None`` drops it: the node stays silent).
    """

    def __init__(self, run_config: dict[str, Any], num_nodes: int,
                 tamper: Tamper | None = None) -> None:
        self.run_config = run_config
        self.nodes = list(range(101, 101 + num_nodes))
        self.tamper = tamper
        self.waiting: list[Message] = []
        self.pulls = 0
        self._run: Any = None
        # Outside a Flower process nothing sets who is sending: Flower's Message needs it.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each destination node's ClientApp now; queue its reply for pulling."""
        self.waiting = []
        ids = []
        for msg in messages:
            # What Flower's grids do on push: the id the replies will refer to.
            msg.metadata.__dict__["_message_id"] = msg.object_id
            node = msg.metadata.dst_node_id
            pid = self.nodes.index(node)
            ctx = Context(run_id=1, node_id=node, state=RecordDict(),
                          node_config={"partition-id": pid, "num-partitions": len(self.nodes)},
                          run_config=self.run_config)
            reply = client_app(msg, ctx)
            reply = self.tamper(pid, reply) if self.tamper else reply
            if reply is not None:
                self.waiting.append(reply)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """One queued reply per pull, as replies trickle in from real nodes."""
        self.pulls += 1
        return [self.waiting.pop(0)] if self.waiting else []

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push, then hand back every reply at once."""
        self.push_messages(messages)
        replies, self.waiting = self.waiting, []
        return replies
