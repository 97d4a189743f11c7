"""Shared fixtures: a tiny, fast configuration of the real pipeline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmitr_core.config import FedMITRConfig, parse_config  # noqa: E402

torch.set_num_threads(2)

# Small enough for CI on 2 cores, large enough to learn something.
TINY = {
    "local-epochs": 15,
    "syn-images": 40,
    "syn-batch-size": 20,
    "inv-iterations": 20,
    "distill-epochs": 5,
    "ensemble-form": "loop",
}


@pytest.fixture
def tiny_run_config() -> dict:
    return dict(TINY)


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> FedMITRConfig:
    return parse_config({**TINY, "output-dir": str(tmp_path / "out"), "run-name": "t"})


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages made outside a Flower process need a task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1
