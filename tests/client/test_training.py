"""Local training on a client: seeded, and what it reports."""

import numpy as np
import torch

from fedmitr_core.client.training import client_seed, simulate_clients
from fedmitr_core.config import parse_config


def test_same_seed_same_metrics(tiny_run_config, tmp_path):
    cfg = parse_config({**tiny_run_config, "local-epochs": 3})
    _, first = simulate_clients(cfg, 3)
    _, second = simulate_clients(cfg, 3)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a.label_counts, b.label_counts)
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def test_each_client_and_round_gets_its_own_seed():
    seeds = {client_seed(0, c, r) for c in range(50) for r in (1, 2, 3)}
    assert len(seeds) == 150
    assert client_seed(1, 0) != client_seed(0, 0)
