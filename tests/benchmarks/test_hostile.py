"""The hostile-client benchmark: each attack is built as described and met by the right screen."""

import numpy as np

from benchmarks.hostile import ATTACKER, INFLATE, attacks, defended, table
from fedmitr_core.client.training import initial_model
from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.server.ensemble import TeacherSet


def test_each_attack_meets_the_screen_meant_for_it(micro_vit, tmp_path):
    cfg = parse_config({})
    data = load_dataset(cfg.data, cfg.seed)
    initial = initial_model(cfg, data.spec).state_dict()
    teachers = TeacherSet([micro_vit(seed=10 + k) for k in range(5)], np.full((5, 10), 20),
                          [f"c{k}" for k in range(5)])
    attacked = attacks(teachers, initial, cfg, data)
    assert set(attacked) == {"random+claims", "random", "boosted", "own+claims", "huge"}
    claims = attacked["own+claims"].label_counts[ATTACKER]
    assert claims.tolist() == [21 * INFLATE] * 10
    assert attacked["own+claims"].models[ATTACKER] is teachers.models[ATTACKER]
    actions = {name: defended(t, initial, cfg)[1] for name, t in attacked.items()}
    assert actions["huge"] == "rejected on arrival"
    assert actions["boosted"] == "dropped (outlier-ratio)"
    assert actions["own+claims"] == actions["random+claims"] == "capped (count-cap)"
    kept, _ = defended(attacked["huge"], initial, cfg)
    assert len(kept) == 4 and "c0" not in kept.client_ids
    record = {"alpha": 0.5, "seed": 0, "margins": {"claim-ratio": 1.0},
              "honest": {"off": {"ensemble": 80.0, "fedavg": 20.0},
                         "on": {"ensemble": 80.0, "fedavg": 20.0},
                         "defence": "dropped 0, capped 0"},
              "attacks": {"huge": {"off": {"ensemble": 10.0, "fedavg": 10.0},
                                   "on": {"ensemble": 79.0, "fedavg": 21.0},
                                   "defence": actions["huge"]}}}
    text = table([record])
    assert "| huge | 10.0 / 10.0 | 79.0 / 21.0 | rejected on arrival |" in text
    assert "| none (honest) | 80.0 / 20.0 | 80.0 / 20.0 | dropped 0, capped 0 |" in text
