"""The generator baselines' shared loop: its budget, and checkpoint and resume for each."""

import pytest
import torch

from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import DataSpec
from fedmitr_core.methods import METHODS
from fedmitr_core.methods.base import ServerContext
from fedmitr_core.methods.generator_kd import GeneratorKD, run_generator_kd
from fedmitr_core.synthesis.generator import ImageGenerator
from fedmitr_core.synthesis.generator_synthesis import GeneratorRecipe, GeneratorSynthesizer
from fedmitr_core.synthesis.losses import DenseGeneratorLoss

SPEC = DataSpec(4, 16, 1, (0.0,), (1.0,), ("a", "b", "c", "d"))


def _context(teachers, ensemble, state_dir=None, **run_config):
    cfg = parse_config({"gen-nz": 8, "gen-width": 8, "gen-steps": 2, **run_config})
    return ServerContext(teachers=teachers, ensemble=ensemble, cfg=cfg, spec=SPEC,
                         device=torch.device("cpu"), state_dir=state_dir)


def test_the_loop_spends_exactly_the_budget(constant_teachers, right_and_wrong):
    ens = right_and_wrong
    # 10 images in 3 rounds; 7 epochs of 1 step (batch 10 >= 10 images): 7 student steps.
    ctx = _context(constant_teachers, ens, **{"syn-images": 10, "gen-rounds": 3,
                                               "distill-epochs": 7, "distill-batch-size": 10,
                                               "live-shift": 0})
    weights = lambda y: torch.full((2, len(y)), 0.5)  # noqa: E731
    recipe = GeneratorRecipe(DenseGeneratorLoss(1.0, 1.0), weights, optimise_noise=True,
                             reset_each_round=False, label_sampler=None)
    synth = GeneratorSynthesizer(ImageGenerator(8, (1, 16, 16), 8), ens, recipe,
                                 ctx.cfg.baseline)
    pool_sizes, step_rounds = [], []
    method = GeneratorKD("t", synth, temperature=3.0,
                         perturbation=lambda x, y, r: step_rounds.append(r) or x,
                         before_round=lambda x, y, r: pool_sizes.append(len(y)))
    out = run_generator_kd(ctx, method, torch.Generator().manual_seed(0))
    assert pool_sizes == [4, 7, 10] and out.details["pool-size"] == 10
    assert step_rounds == [0, 0, 0, 1, 1, 2, 2]
    # DENSE's unconditional labels are the ensemble's predictions: both teachers tie at
    # 0.5 · 3 on classes 0 and 1, and argmax takes the first: every image is on target.
    assert out.details["pool-on-target"] == 1.0
    assert all(p.requires_grad for p in out.model.parameters())


@pytest.mark.parametrize("name", ["dense", "coboosting", "fedftg"])
def test_a_crash_mid_run_then_resume_equals_an_uninterrupted_run(
        constant_teachers, right_and_wrong, tmp_path, monkeypatch, name):
    keys = {"syn-images": 16, "gen-rounds": 4, "distill-epochs": 4, "distill-batch-size": 8,
            "checkpoint-every": 1}

    def run(state_dir):
        return METHODS[name](_context(constant_teachers, right_and_wrong, state_dir, **keys))

    whole = run(tmp_path / "whole")
    real = GeneratorSynthesizer.synthesize
    calls = []

    def crash_in_round_three(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("server stopped")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GeneratorSynthesizer, "synthesize", crash_in_round_three)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "crashed")
    monkeypatch.setattr(GeneratorSynthesizer, "synthesize", real)
    checkpoint = torch.load(tmp_path / "crashed" / name / "distill.pt", weights_only=True)
    assert checkpoint["done"] == 2  # rounds 1 and 2 were saved (2 epochs' worth of steps)
    resumed = run(tmp_path / "crashed")
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.details == whole.details
