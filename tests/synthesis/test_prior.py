"""The token-statistics prior: the loss, every ensemble form, inversion and the generators."""

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmitr_core.config import ConfigError, InversionConfig, PriorConfig
from fedmitr_core.data.datasets import DataSpec
from fedmitr_core.models.token_stats import token_statistics
from fedmitr_core.models.tokens import forward_gathered_layers, token_moments
from fedmitr_core.models.vit import build_vit
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.synthesis.inversion import ModelInverter
from fedmitr_core.synthesis.prior import (
    ClassMomentsStatsPrior,
    CombinedPrior,
    FeatureStatsPrior,
    FrozenTokens,
    PatchSimilarityPrior,
    masked_sums,
    similarity_entropy,
    synthesis_prior,
)

SPEC = DataSpec(10, 16, 1, (0.0,), (1.0,), tuple(map(str, range(10))))
CPU = torch.device("cpu")


def _vit(seed):
    torch.manual_seed(seed)
    return build_vit("vit-micro", 10, 16, 1, 4).eval()


def _smooth_images(n, seed=0):
    """Blurred noise: images whose token statistics differ from white noise's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 16, 16, generator=gen)
    return F.avg_pool2d(x, 5, stride=1, padding=2) * 3


def _teachers(k=3, with_stats=(True, True, True)):
    models = [_vit(i) for i in range(k)]
    stats = [token_statistics(m, _smooth_images(64, seed=i)) if s else None
             for i, (m, s) in enumerate(zip(models, with_stats, strict=True))]
    counts = np.full((k, 10), 5)
    return TeacherSet(models, counts, client_ids=[f"c{i}" for i in range(k)], token_stats=stats)


def _prior(ens, weight=1.0, teachers="uniform", layers="all-but-last", **settings):
    settings = PriorConfig(feature_stats_layers=layers, feature_stats_teachers=teachers,
                           **settings)
    return synthesis_prior(ens, settings, weight)


def test_the_prior_is_zero_at_the_targets_and_skips_teachers_without_statistics():
    ens = TeacherEnsemble(_teachers(3, (True, False, True)), "class", "loop", CPU)
    prior = _prior(ens)
    target_mean, target_var = ens.stats_targets()
    weights = ens.target_weights(torch.arange(4))
    loss, parts = prior((target_mean, target_var), weights)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    assert parts["stats"] == pytest.approx(0.0, abs=1e-6)
    moved_mean = target_mean.clone()
    moved_mean[1] += 100.0  # the teacher without statistics: nothing to match
    assert float(prior((moved_mean, target_var), weights)[0]) == pytest.approx(0.0, abs=1e-6)
    moved_mean[0, 0] += 1.0  # layer 0 of a reporting teacher, share 1/2
    assert float(prior((moved_mean, target_var), weights)[0]) == pytest.approx(
        0.5 * np.sqrt(ens.models[0].embed_dim), rel=1e-4)


def _split_classes_ensemble(form="loop", **options):
    """Two teachers with statistics: teacher 0 holds classes 0-4, teacher 1 classes 5-9."""
    counts = np.zeros((2, 10), dtype=int)
    counts[0, :5], counts[1, 5:] = 10, 10
    teachers = _teachers(2, (True, True))
    teachers = TeacherSet(teachers.models, counts, teachers.client_ids, teachers.token_stats)
    return TeacherEnsemble(teachers, "class", form, CPU, **options)


def test_class_shares_weight_each_teacher_by_the_batchs_classes():
    ens = _split_classes_ensemble()
    prior = _prior(ens, teachers="class")
    shares = prior.teacher_shares(ens.target_weights(torch.tensor([0, 1, 2, 7])))
    torch.testing.assert_close(shares, torch.tensor([0.75, 0.25]))
    uniform = _prior(ens).teacher_shares(ens.target_weights(torch.tensor([0, 1, 2, 7])))
    torch.testing.assert_close(uniform, torch.tensor([0.5, 0.5]))
    # Only teacher 1 reported, and the batch holds only teacher 0's classes: the
    # reporting teachers share uniformly rather than not at all.
    mean, var = ens.stats_targets()
    only_one = FeatureStatsPrior(1.0, mean, var, torch.tensor([False, True]), [0], "class")
    torch.testing.assert_close(only_one.teacher_shares(ens.target_weights(torch.tensor([0, 1]))),
                               torch.tensor([0.0, 1.0]))


def test_class_moments_match_each_teacher_on_the_images_of_its_classes_only():
    ens = _split_classes_ensemble()
    prior = _prior(ens, teachers="class-moments")
    assert isinstance(prior, ClassMomentsStatsPrior)
    mean, var = ens.stats_targets()  # (2, 4, 48)
    labels = torch.tensor([0, 1, 7, 8])
    # Per image: teacher k sees its targets on the images of its own classes and
    # something far off (+50) on the other teacher's images.
    first = mean[:, :, None, :].repeat(1, 1, 4, 1)
    first[0, :, 2:] += 50.0
    first[1, :, :2] += 50.0
    second = (var + mean * mean)[:, :, None, :].repeat(1, 1, 4, 1)
    first.requires_grad_(True)
    loss, parts = prior((first, second), ens.target_weights(labels))
    assert parts["stats"] == pytest.approx(0.0, abs=1e-3)
    loss.backward()
    # The far-off images are not the teacher's to pull: no gradient reaches them.
    assert float(first.grad[0, :, 2:].abs().max()) == 0.0
    assert float(first.grad[1, :, :2].abs().max()) == 0.0
    # The batch-level weighting pools every image into each teacher's moments.
    pooled = _prior(ens, teachers="class")
    pooled_mean = first.detach().mean(dim=2)
    pooled_var = second.mean(dim=2) - pooled_mean * pooled_mean
    assert float(pooled((pooled_mean, pooled_var), ens.target_weights(labels))[0]) > 100.0


def test_class_moments_equal_the_batch_moments_when_every_teacher_holds_every_class():
    ens = TeacherEnsemble(_teachers(3), "class", "loop", CPU)  # 5 of every class each
    x, keep = _smooth_images(6), torch.tensor([[0, 3, 4, 8, 12, 15]] * 6)
    weights = ens.target_weights(torch.arange(6))
    values = []
    for teachers in ("class", "class-moments"):
        prior = _prior(ens, teachers=teachers)
        _, _, reduced = ens.teacher_outputs_layers(x, keep, prior.reduce)
        values.append(float(prior(reduced, weights)[0]))
    assert values[1] == pytest.approx(values[0], rel=1e-4)


@pytest.mark.parametrize("chunk_size", [32, 1])
def test_class_moments_give_the_loops_loss_and_gradient_under_vmap(chunk_size):
    grads, losses = [], []
    for ens in (_split_classes_ensemble("loop"),
                _split_classes_ensemble("vmap", chunk_size=chunk_size)):
        prior = _prior(ens, teachers="class-moments")
        x = _smooth_images(4).requires_grad_(True)
        _, _, reduced = ens.teacher_outputs_layers(x, None, prior.reduce)
        assert reduced[0].shape == (2, 4, 4, 48)  # (K, layers, B, D)
        loss = prior(reduced, ens.target_weights(torch.tensor([0, 1, 7, 8])))[0]
        loss.backward()
        losses.append(float(loss))
        grads.append(x.grad)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_class_moments_read_the_kept_tokens_only():
    with pytest.raises(ConfigError, match="feature-stats-pruned"):
        PriorConfig(feature_stats_teachers="class-moments", feature_stats_pruned="frozen")


def test_a_teachers_pull_is_bounded_by_its_share_however_far_off_its_statistics():
    ens = TeacherEnsemble(_teachers(2, (True, True)), "uniform", "loop", CPU)
    mean, var = ens.stats_targets()
    batch_mean = (mean + 0.1).requires_grad_(True)
    batch_var = var.clone().requires_grad_(True)
    mean[1] *= 1e6  # one client reports absurd statistics
    prior = FeatureStatsPrior(1.0, mean, var, torch.tensor([True, True]), [0, 1, 2])
    prior((batch_mean, batch_var), torch.ones(2, 3))[0].backward()
    # Unsquared norms: each matched layer's gradient from teacher k has norm a_k = 1/2.
    norms = batch_mean.grad.norm(dim=-1)[:, :3]
    torch.testing.assert_close(norms, torch.full_like(norms, 0.5))


def test_no_prior_when_switched_off_weighted_zero_or_no_teacher_sent_statistics():
    ens = TeacherEnsemble(_teachers(2, (True, True)), "uniform", "loop", CPU)
    assert _prior(ens, weight=0.0) is None
    assert synthesis_prior(ens, PriorConfig(feature_stats=False), 3.0) is None
    bare = TeacherEnsemble(_teachers(2, (False, False)), "uniform", "loop", CPU)
    assert _prior(bare) is None
    with pytest.raises(ValueError, match="no teacher"):
        bare.stats_targets()


@pytest.mark.parametrize(("form", "chunk_size"), [("vmap", 32), ("vmap", 2), ("loop", 2)])
def test_every_ensemble_form_gives_the_loops_moments_and_gradients(form, chunk_size):
    teachers = _teachers(3)
    loop = TeacherEnsemble(teachers, "class", "loop", CPU)
    other = TeacherEnsemble(teachers, "class", form, CPU, chunk_size=chunk_size)
    keep = torch.tensor([[0, 3, 4, 8, 12]] * 4)
    outs, grads = [], []
    for ens in (loop, other):
        x = _smooth_images(4).requires_grad_(True)
        logits, attn, (mean, var) = ens.teacher_outputs_layers(x, keep, token_moments)
        assert mean.shape == var.shape == (3, 4, 48)
        (mean.square().sum() + var.sum() + logits.sum()).backward()
        outs.append((logits, attn, mean, var))
        grads.append(x.grad)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def _final_distance(ens, images):
    mean, var = ens.stats_targets()
    with torch.no_grad():
        _, _, (m, v) = ens.teacher_outputs_layers(images, None, token_moments)
    return float(((m - mean)[:, :3].norm(dim=-1) + (v - var)[:, :3].norm(dim=-1)).sum())


@pytest.mark.parametrize(("sparse", "teachers"),
                         [(False, "uniform"), (True, "uniform"), (True, "class-moments")])
def test_inversion_with_the_prior_ends_closer_to_the_clients_statistics(sparse, teachers):
    ens = TeacherEnsemble(_teachers(3), "class", "loop", CPU)
    settings = InversionConfig(inv_iterations=30, inv_lr=0.1, prune_at=(0.5,),
                               pruned_patches="keep")
    distances = {}
    for weight in (0.0, 3.0):
        inverter = ModelInverter(ens, settings, SPEC, 4, sparse=sparse, label_temperature=3.0,
                                 prior=_prior(ens, weight=weight, teachers=teachers))
        pool = inverter.synthesize(torch.arange(8) % 10, torch.Generator().manual_seed(0))
        distances[weight] = _final_distance(ens, pool.images)
    assert distances[3.0] < 0.7 * distances[0.0]


def test_sparse_inversion_matches_the_kept_tokens(monkeypatch):
    ens = TeacherEnsemble(_teachers(3), "class", "loop", CPU)
    seen = []
    original = ens.teacher_outputs_layers

    def spy(images, keep_idx, reduce):
        seen.append(None if keep_idx is None else keep_idx.shape[1])
        return original(images, keep_idx, reduce)

    monkeypatch.setattr(ens, "teacher_outputs_layers", spy)
    settings = replace(InversionConfig(), inv_iterations=10, prune_at=(0.3, 0.6))
    ModelInverter(ens, settings, SPEC, 4, sparse=True, label_temperature=3.0,
                  prior=_prior(ens)).synthesize(torch.arange(4), torch.Generator().manual_seed(0))
    # 16 patches, 30 % pruned after steps 3 and 6: 16, then 12, then 9 tokens matched.
    assert seen == [16] * 3 + [12] * 3 + [9] * 4


def test_kept_and_frozen_moments_merge_into_the_moments_of_every_token():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, 4, 16, 8, generator=gen) * 3 + 1  # (K, B, n, D)
    pruned = torch.zeros(4, 16, dtype=torch.bool)
    pruned[:, 10:] = True  # the last 6 patches of every image were pruned
    kept = [token_moments(t[:, :10]) for t in tokens]
    sums = [masked_sums(pruned)(t) for t in tokens]
    frozen = FrozenTokens(torch.stack([f for f, _ in sums]).unsqueeze(1),
                          torch.stack([s for _, s in sums]).unsqueeze(1), count=24, kept=40)
    mean, var = frozen.merge(torch.stack([m for m, _ in kept]).unsqueeze(1),
                             torch.stack([v for _, v in kept]).unsqueeze(1))
    every = [token_moments(t) for t in tokens]
    torch.testing.assert_close(mean[:, 0], torch.stack([m for m, _ in every]))
    torch.testing.assert_close(var[:, 0], torch.stack([v for _, v in every]), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("pruned", ["kept", "frozen"])
def test_sparse_inversion_counts_the_pruned_tokens_only_when_asked(monkeypatch, pruned):
    ens = TeacherEnsemble(_teachers(3), "class", "loop", CPU)
    prior = _prior(ens, feature_stats_pruned=pruned)
    calls = []
    original = prior.forward

    def spy(reduced, weights, frozen=None):
        calls.append(frozen)
        return original(reduced, weights, frozen)

    monkeypatch.setattr(prior, "forward", spy)
    settings = replace(InversionConfig(), inv_iterations=10, prune_at=(0.3, 0.6))
    images = torch.Generator().manual_seed(0)
    ModelInverter(ens, settings, SPEC, 4, sparse=True, label_temperature=3.0,
                  prior=prior).synthesize(torch.arange(4), images)
    if pruned == "kept":
        assert calls == [None] * 10
        return
    # 4 images, 16 patches: 4 pruned from each after step 3, 3 more after step 6.
    assert calls[:3] == [None] * 3
    assert [(f.count, f.kept) for f in calls[3:]] == [(16, 48)] * 3 + [(28, 36)] * 4
    assert calls[3].first.shape == (3, 4, 48)


def test_the_frozen_tokens_are_read_in_the_context_they_were_pruned_from():
    ens = TeacherEnsemble(_teachers(3), "class", "vmap", CPU)
    prior = _prior(ens, feature_stats_pruned="frozen")
    inverter = ModelInverter(ens, InversionConfig(), SPEC, 4, sparse=True,
                             label_temperature=3.0, prior=prior)
    images = _smooth_images(2)
    keep = torch.tensor([[0, 2, 5, 7, 9, 11], [1, 3, 4, 6, 8, 15]])
    dropped = torch.tensor([[1, 4], [0, 5]])  # positions in keep: patches 2, 9 and 1, 15
    frozen = inverter._freeze(images, keep, dropped, None)
    assert (frozen.count, frozen.kept) == (4, 8)
    for k, model in enumerate(ens.models):
        _, _, (tokens,) = forward_gathered_layers(model, images, keep, lambda p: (p,))
        chosen = torch.stack([tokens[:, 0, [1, 4]], tokens[:, 1, [0, 5]]], dim=1)
        torch.testing.assert_close(frozen.first[k], chosen.sum(dim=(1, 2)), atol=1e-4,
                                   rtol=1e-4)
        torch.testing.assert_close(frozen.second[k], chosen.pow(2).sum(dim=(1, 2)), atol=1e-4,
                                   rtol=1e-4)


def test_the_generator_baselines_add_the_prior_to_their_loss():
    from fedmitr_core.config import parse_config
    from fedmitr_core.methods.generator_kd import uniform_sampler
    from fedmitr_core.synthesis.generator import ImageGenerator
    from fedmitr_core.synthesis.generator_synthesis import GeneratorRecipe, GeneratorSynthesizer
    from fedmitr_core.synthesis.losses import DenseGeneratorLoss

    ens = TeacherEnsemble(_teachers(3), "class", "loop", CPU)
    recipe = GeneratorRecipe(DenseGeneratorLoss(1.0, 1.0), ens.target_weights,
                             optimise_noise=True, reset_each_round=True,
                             label_sampler=uniform_sampler(10))
    settings = parse_config({"gen-steps": 25, "gen-lr": 0.01}).baseline
    student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 10))
    distances, parts = {}, {}
    for weight in (0.0, 3.0):
        g = ImageGenerator(16, (1, 16, 16), 8, rng=torch.Generator().manual_seed(0))
        synth = GeneratorSynthesizer(g, ens, recipe, settings, prior=_prior(ens, weight=weight))
        images, _, parts[weight] = synth.synthesize(16, student, torch.Generator().manual_seed(0))
        distances[weight] = _final_distance(ens, images)
    assert "stats" in parts[3.0] and "stats" not in parts[0.0]
    assert distances[3.0] < 0.8 * distances[0.0]


def test_similarity_entropy_is_low_for_near_identical_patches_and_higher_for_varied_ones():
    gen = torch.Generator().manual_seed(0)
    alike = torch.randn(2, 1, 8, generator=gen) + 0.05 * torch.randn(2, 16, 8, generator=gen)
    varied = torch.randn(2, 16, 8, generator=gen)
    low, high = similarity_entropy(alike), similarity_entropy(varied)
    assert low.shape == high.shape == (2,)
    assert (high > low + 0.5).all()


def test_the_fallback_prior_covers_exactly_the_teachers_without_statistics():
    ens = TeacherEnsemble(_teachers(3, (True, False, True)), "class", "loop", CPU)
    combined = _prior(ens, fallback_prior="patch-similarity")
    assert isinstance(combined, CombinedPrior)
    stats, similarity = combined.priors
    torch.testing.assert_close(stats.available, torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(similarity.shares, torch.tensor([0.0, 1.0, 0.0]))
    # feature-stats=false: every teacher is without statistics, the fallback covers all.
    alone = _prior(ens, fallback_prior="patch-similarity", feature_stats=False)
    assert isinstance(alone, PatchSimilarityPrior)
    torch.testing.assert_close(alone.shares, torch.full((3,), 1 / 3))
    # Both read from one forward, in every ensemble form alike.
    x = _smooth_images(4)
    for form in ("loop", "vmap"):
        other = TeacherEnsemble(_teachers(3, (True, False, True)), "class", form, CPU)
        _, _, reduced = other.teacher_outputs_layers(x, None, combined.reduce)
        loss, parts = combined(reduced, other.target_weights(torch.arange(4)))
        assert set(parts) == {"stats", "similarity"} and torch.isfinite(loss)


def test_inversion_with_the_patch_similarity_prior_raises_the_entropy():
    ens = TeacherEnsemble(_teachers(3, (False, False, False)), "class", "loop", CPU)
    settings = InversionConfig(inv_iterations=30, inv_lr=0.1)
    entropies = {}
    for weight in (0.0, 5.0):
        prior = _prior(ens, fallback_prior="patch-similarity", fallback_prior_weight=weight)
        inverter = ModelInverter(ens, settings, SPEC, 4, sparse=False, label_temperature=3.0,
                                 prior=prior)
        pool = inverter.synthesize(torch.arange(8) % 10, torch.Generator().manual_seed(0))
        probe = PatchSimilarityPrior(1.0, torch.ones(3, dtype=torch.bool), 3)
        with torch.no_grad():
            _, _, reduced = ens.teacher_outputs_layers(pool.images, None, probe.reduce)
        entropies[weight] = -float(probe(reduced, ens.target_weights(torch.arange(8)))[0])
    assert _prior(ens, fallback_prior="patch-similarity", fallback_prior_weight=0.0) is None
    assert entropies[5.0] > entropies[0.0]
