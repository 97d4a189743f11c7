"""Server methods by name: one entry point each, ``(ServerContext) -> MethodResult``."""

from __future__ import annotations

from fedmitr_core.methods.base import MethodResult, ServerContext, ServerMethod
from fedmitr_core.methods.coboosting import run_coboosting
from fedmitr_core.methods.dense import run_dense
from fedmitr_core.methods.distillation import (
    run_deepinversion,
    run_fedmitr,
    run_fedmitr_relabel,
    run_fedmitr_sparse,
    run_kd_real,
)
from fedmitr_core.methods.fedavg import run_fedavg
from fedmitr_core.methods.fedftg import run_fedftg

METHODS: dict[str, ServerMethod] = {
    "fedmitr": run_fedmitr,
    "deepinversion": run_deepinversion,
    "fedmitr-sparse": run_fedmitr_sparse,
    "fedmitr-relabel": run_fedmitr_relabel,
    "fedavg": run_fedavg,
    "kd-real": run_kd_real,
    "dense": run_dense,
    "coboosting": run_coboosting,
    "fedftg": run_fedftg,
}

# References that need more rounds with the clients: run by the ServerApp after the
# one-shot round (server_app/fedavg_rounds.py), not on the one-shot uploads.
ROUND_METHODS: frozenset[str] = frozenset({"fedavg-rounds"})

__all__ = ["METHODS", "ROUND_METHODS", "MethodResult", "ServerContext", "ServerMethod"]
