"""Server methods by name: one entry point each, ``(ServerContext) -> MethodResult``.

Which methods share a synthetic pool, and the random stream each pool comes
from: ``POOLS`` and ``RNG_STREAMS`` in ``methods/base.py``.
"""

from __future__ import annotations

from typing import get_args

from fedmitr_core.config import RoundMethod
from fedmitr_core.methods.base import POOLS, MethodResult, ServerContext, ServerMethod
from fedmitr_core.methods.coboosting import run_coboosting
from fedmitr_core.methods.dense import run_dense
from fedmitr_core.methods.fedavg import run_fedavg
from fedmitr_core.methods.fedftg import run_fedftg
from fedmitr_core.methods.inversion_kd import (
    run_deepinversion,
    run_fedmitr,
    run_fedmitr_relabel,
    run_fedmitr_sparse,
    run_kd_real,
)

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

# The one-shot methods FedMITR is measured against (the benchmark's leads.md).
BASELINES: tuple[str, ...] = ("deepinversion", "dense", "coboosting", "fedftg", "fedavg")

# References that need more rounds with the clients: run by the ServerApp after the
# one-shot round (server_app/fedavg_rounds.py), not on the one-shot uploads.
ROUND_METHODS: frozenset[str] = frozenset(get_args(RoundMethod))

__all__ = ["BASELINES", "METHODS", "POOLS", "ROUND_METHODS", "MethodResult", "ServerContext",
           "ServerMethod"]
