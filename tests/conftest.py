"""Shared fixtures: a tiny, fast configuration of the real pipeline and its parts."""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
import torch

from fedmitr_core.config import FedMITRConfig, parse_config
from fedmitr_core.models.vit import build_vit
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet

torch.set_num_threads(2)

ROOT = Path(__file__).resolve().parents[1]

# Small enough for CI on 2 cores, large enough to learn something.
TINY = {
    "local-epochs": 15,
    "syn-images": 40,
    "syn-batch-size": 20,
    "inv-iterations": 20,
    "distill-epochs": 5,
    "ensemble-form": "loop",
}


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The project checkout (where ``pyproject.toml`` and ``sim_configs/`` are)."""
    return ROOT


@pytest.fixture(scope="session")
def tiny() -> Mapping:
    """Run-config keys of the tiny budget, read-only (for fixtures of any scope)."""
    return MappingProxyType(TINY)


@pytest.fixture
def tiny_run_config() -> dict:
    """Run-config keys of the tiny budget (a fresh copy per test)."""
    return dict(TINY)


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> FedMITRConfig:
    """The tiny budget as a parsed config writing under ``tmp_path``."""
    return parse_config({**TINY, "output-dir": str(tmp_path / "out"), "run-name": "t"})


@pytest.fixture
def micro_vit() -> Callable[..., torch.nn.Module]:
    """``micro_vit(seed=None, num_classes=10, patch_size=4)``: a 16 px grey micro ViT."""

    def make(seed: int | None = None, num_classes: int = 10, patch_size: int = 4
             ) -> torch.nn.Module:
        if seed is not None:
            torch.manual_seed(seed)
        return build_vit("vit-micro", num_classes, 16, 1, patch_size).eval()

    return make


@pytest.fixture
def micro_ensemble(micro_vit) -> Callable[..., TeacherEnsemble]:
    """``micro_ensemble(k=3, counts=5)``: k seeded micro ViTs, equal label counts, the loop."""

    def make(k: int = 3, counts: int = 5, weighting: str = "class") -> TeacherEnsemble:
        teachers = TeacherSet([micro_vit(seed=i) for i in range(k)], np.full((k, 10), counts))
        return TeacherEnsemble(teachers, weighting, "loop", torch.device("cpu"))

    return make


def find_free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """``free_port()``: a TCP port nothing listens on now."""
    return find_free_port


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages made outside a Flower process need a task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1


def _constant_teacher(favoured: int, num_classes: int = 4) -> torch.nn.Module:
    """A real micro ViT whose logits are a constant vote for ``favoured``."""
    vit = build_vit("vit-micro", num_classes, 16, 1, 4)
    with torch.no_grad():
        vit.head.weight.zero_()
        vit.head.bias.fill_(0.0)
        vit.head.bias[favoured] = 3.0
    return vit.eval()


@pytest.fixture
def constant_teachers() -> TeacherSet:
    """Two constant teachers over 4 classes: one votes class 0, the other class 1."""
    return TeacherSet([_constant_teacher(0), _constant_teacher(1)], np.full((2, 4), 5),
                      client_ids=["right", "wrong"])


@pytest.fixture
def right_and_wrong(constant_teachers) -> TeacherEnsemble:
    """The constant teachers as a uniform ensemble (the loop form, on CPU)."""
    return TeacherEnsemble(constant_teachers, "uniform", "loop", torch.device("cpu"))


@pytest.fixture
def initial_arrays() -> Callable:
    """``initial_arrays(cfg)``: the run's splits and its initial model as an ArrayRecord."""
    from flwr.app import ArrayRecord

    from fedmitr_core.client.training import initial_model
    from fedmitr_core.data.datasets import load_dataset

    def make(cfg: FedMITRConfig):
        splits = load_dataset(cfg.data, cfg.seed)
        return splits, ArrayRecord(initial_model(cfg, splits.spec).state_dict())

    return make


@pytest.fixture
def timm_checkpoint_in_hf_cache(tmp_path: Path, monkeypatch) -> Callable[[str], dict]:
    """``put(name)``: a random checkpoint of timm model ``name`` where timm's download finds it.

    Written in the Hugging Face cache layout (``refs/main`` -> ``snapshots/<commit>/``)
    of a fresh ``HF_HOME``, so ``pretrained=<name>`` runs timm's real hub path
    offline, in this process and in the processes it starts. Returns the state dict.
    """
    import huggingface_hub.constants as hf
    import timm
    from safetensors.torch import save_file

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)

    def put(name: str) -> dict:
        model = timm.create_model(name, pretrained=False)
        repo = home / "hub" / f"models--{model.pretrained_cfg['hf_hub_id'].replace('/', '--')}"
        commit = "0" * 40
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(repo / "snapshots" / commit / "model.safetensors"))
        return state

    return put
