"""The generator baselines' shared loop: its budget, and checkpoint and resume for each."""

import pytest
import torch

from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import DataSpec
from fedmitr_core.methods import METHODS
from fedmitr_core.methods.base import ServerContext
from fedmitr_core.methods.generator_kd import (
    GeneratorKD,
    pool_batches,
    run_generator_kd,
    student_steps,
    uniform_sampler,
)
from fedmitr_core.synthesis.generator import ImageGenerator
from fedmitr_core.synthesis.generator_synthesis import (
    GeneratorRecipe,
    GeneratorSynthesizer,
    eight_bit,
)
from fedmitr_core.synthesis.losses import DenseGeneratorLoss

SPEC = DataSpec(4, 16, 1, (0.0,), (1.0,), ("a", "b", "c", "d"))


def _context(teachers, ensemble, state_dir=None, **run_config):
    cfg = parse_config({"gen-nz": 8, "gen-width": 8, "gen-steps": 2, **run_config})
    return ServerContext(teachers=teachers, ensemble=ensemble, cfg=cfg, spec=SPEC,
                         device=torch.device("cpu"), state_dir=state_dir)


def _recipe(**kwargs):
    weights = lambda y: torch.full((2, len(y)), 0.5)  # noqa: E731
    return GeneratorRecipe(DenseGeneratorLoss(1.0, 1.0), weights, optimise_noise=True,
                           label_sampler=uniform_sampler(4), **kwargs)


@pytest.mark.parametrize("passes", [False, True])
def test_the_loop_spends_exactly_the_budget(constant_teachers, right_and_wrong, passes):
    ens = right_and_wrong
    # 10 images in 3 rounds; 7 epochs of 1 step (batch 10 >= 10 images): 7 student steps.
    ctx = _context(constant_teachers, ens, **{"syn-images": 10, "gen-rounds": 3,
                                               "distill-epochs": 7, "distill-batch-size": 10,
                                               "live-shift": 0})
    synth = GeneratorSynthesizer(ImageGenerator(8, (1, 16, 16), 8), ens,
                                 _recipe(reset_each_round=False), ctx.cfg.baseline)
    pool_sizes, step_rounds = [], []
    method = GeneratorKD("t", synth, temperature=3.0,
                         perturbation=lambda x, y, r: step_rounds.append(r) or x,
                         before_joining=lambda x, y, r: pool_sizes.append(len(y)),
                         passes_over_pool=passes)
    out = run_generator_kd(ctx, method, torch.Generator().manual_seed(0))
    # The hook sees the pool before each round's batch joins it (none before round 0).
    assert pool_sizes == [4, 7] and out.details["pool-size"] == 10
    # Evenly 3, 2, 2; in proportion to the pool (4, 7, 10 images): 1, 2, 4 (7 · 4/21 = 1.33,
    # 7 · 7/21 = 2.33, 7 · 10/21 = 3.33: equal remainders, the last round rounds up).
    per_round = [step_rounds.count(r) for r in range(3)]
    assert per_round == ([1, 2, 4] if passes else [3, 2, 2])
    assert all(p.requires_grad for p in out.model.parameters())


def test_shuffled_passes_visit_every_pool_image_once_per_pass():
    rng = torch.Generator().manual_seed(0)
    batches = list(pool_batches(10, 4, steps=6, passes_over_pool=True, rng=rng))
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert sorted(torch.cat(batches[:3]).tolist()) == list(range(10))
    assert sorted(torch.cat(batches[3:]).tolist()) == list(range(10))
    assert student_steps(100, [60] * 10, passes_over_pool=True)[::9] == [2, 18]
    assert sum(student_steps(100, [60] * 10, passes_over_pool=True)) == 100


def test_a_generator_reset_each_round_starts_every_synthesis_afresh(right_and_wrong):
    def second_start_and_first_end(reset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g = ImageGenerator(8, (1, 16, 16), 8, rng=torch.Generator().manual_seed(1))
        synth = GeneratorSynthesizer(g, right_and_wrong, _recipe(reset_each_round=reset),
                                     parse_config({"gen-steps": 2}).baseline)
        starts = []
        hook = g.project.register_forward_pre_hook(
            lambda m, args: starts.append(m.weight.detach().clone()))
        student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 4))
        rng = torch.Generator().manual_seed(0)
        synth.synthesize(6, student, rng)
        first_end = g.project.weight.detach().clone()
        synth.synthesize(6, student, rng)
        hook.remove()
        return starts[2], first_end  # two steps per synthesis: forward 2 starts the second

    start, end = second_start_and_first_end(reset=True)
    # Re-initialised: a fresh DCGAN draw (std 0.02), not where the first synthesis ended.
    assert not torch.equal(start, end) and abs(float(start.std()) - 0.02) < 0.002
    start, end = second_start_and_first_end(reset=False)
    assert torch.equal(start, end)


def test_pixel_generators_fill_the_pool_with_8_bit_images(right_and_wrong):
    g = ImageGenerator(8, (1, 16, 16), 8, pixels=((0.5,), (0.25,)))
    synth = GeneratorSynthesizer(g, right_and_wrong, _recipe(reset_each_round=True),
                                 parse_config({"gen-steps": 1}).baseline)
    student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 4))
    images, labels, _ = synth.synthesize(5, student, torch.Generator().manual_seed(0))
    pixels = images * 0.25 + 0.5
    assert torch.allclose(pixels * 255, (pixels * 255).round(), atol=1e-3)
    assert torch.equal(eight_bit(torch.tensor([0.0, 0.999, 1.0, 1.5])),
                       torch.tensor([0.0, 254 / 255, 1.0, 1.0]))
    assert labels.shape == (5,)


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


def test_dense_re_initialises_its_generator_for_every_round(constant_teachers, right_and_wrong,
                                                            monkeypatch):
    from fedmitr_core.synthesis import generator_synthesis

    resets = []
    real = generator_synthesis.reset_weights
    monkeypatch.setattr(generator_synthesis, "reset_weights",
                        lambda net, rng=None: resets.append(1) or real(net, rng))
    ctx = _context(constant_teachers, right_and_wrong, **{"syn-images": 12, "gen-rounds": 3,
                                                          "distill-epochs": 1})
    METHODS["dense"](ctx)
    assert len(resets) == 3
