"""The privacy audit flags a pool or a model that gives training images away, and only that."""

import numpy as np
import pytest
import torch

from fedmitr_core.client.training import train_local
from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.models.token_stats import token_statistics
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.privacy.audit import (
    attack_figures,
    audit_pool,
    balanced_members,
    embed_with,
    image_moments,
    loss_attack,
    released_moments,
    tracing_attack,
)


@pytest.fixture(scope="module")
def audit_sets(tiny):
    cfg = parse_config(dict(tiny))
    splits = load_dataset(cfg.data, 0)
    members, non_members = balanced_members(splits.train.subset(np.arange(400)), splits.test,
                                            np.random.default_rng(0))
    return cfg, splits, members, non_members


def test_members_and_non_members_are_balanced_by_class(audit_sets):
    _, _, members, non_members = audit_sets
    assert len(members) > 200
    assert np.array_equal(np.bincount(members.labels.numpy(), minlength=10),
                          np.bincount(non_members.labels.numpy(), minlength=10))


def test_a_pool_that_copies_training_images_is_flagged(audit_sets):
    cfg, splits, members, non_members = audit_sets
    embed = embed_with(vit_factory(cfg.model, splits.spec)())
    report = audit_pool(members.images.clone(), members, non_members, embed)
    for space in ("pixel", "feature"):
        assert report[space]["pool-to-train-min"] == pytest.approx(0.0, abs=1e-3)
        assert report[space]["closer-to-train"] > 0.95
        assert report[space]["pool-attack-auc"] > 0.95


def test_a_pool_of_noise_passes(audit_sets):
    cfg, splits, members, non_members = audit_sets
    embed = embed_with(vit_factory(cfg.model, splits.spec)())
    noise = torch.randn((300, *members.images.shape[1:]),
                        generator=torch.Generator().manual_seed(0))
    report = audit_pool(noise, members, non_members, embed)
    for space in ("pixel", "feature"):
        assert abs(report[space]["pool-attack-auc"] - 0.5) < 0.1
        assert 0.3 < report[space]["closer-to-train"] < 0.7
    assert report["pixel"]["pool-to-train-min"] > 1.0


def test_the_loss_attack_finds_an_overfit_model_and_not_an_untrained_one(audit_sets):
    cfg, splits, members, non_members = audit_sets
    few = np.arange(0, len(members), 4)
    members, non_members = members.subset(few), non_members.subset(few)
    untrained = vit_factory(cfg.model, splits.spec)()
    assert abs(loss_attack(untrained, members, non_members)[0] - 0.5) < 0.1
    overfit = vit_factory(cfg.model, splits.spec)()
    client = parse_config({"local-epochs": 150, "local-shift": 0}).client
    train_local(overfit, members, client, torch.device("cpu"), seed=0)
    assert loss_attack(overfit, members, non_members)[0] > 0.8


def test_released_statistics_are_the_mean_of_the_images_moments(audit_sets):
    cfg, splits, members, _ = audit_sets
    vit = vit_factory(cfg.model, splits.spec)()
    images = members.images[:50]
    rows = image_moments(vit, images, batch_size=16)
    assert torch.allclose(rows.mean(dim=0), released_moments(token_statistics(vit, images)),
                          rtol=1e-4, atol=1e-5)


def test_the_tracing_attack_finds_members_of_a_small_release_and_only_them(tiny):
    cfg = parse_config(dict(tiny))
    splits = load_dataset(cfg.data, 0)
    # Drawn across the whole training split: digits are ordered by writer, and a block
    # of neighbours would share writers with a release of other neighbours.
    drawn = np.random.default_rng(5).permutation(len(splits.train))[:400]
    members, non_members = balanced_members(splits.train.subset(drawn), splits.test,
                                            np.random.default_rng(0))
    torch.manual_seed(0)
    vit = vit_factory(cfg.model, splits.spec)()
    pick = np.sort(np.random.default_rng(1).choice(len(members), 40, replace=False))
    # Same positions in both sets hold the same classes (balanced_members).
    inside, outside = members.subset(pick), non_members.subset(pick)
    few_in, few_out = inside.subset(np.arange(10)), outside.subset(np.arange(10))
    auc, tpr = tracing_attack(vit, token_statistics(vit, few_in.images), few_in, few_out,
                              splits.val)
    assert auc > 0.9 and tpr >= 0.5
    others = np.setdiff1d(np.arange(len(members)), pick)[:10]
    auc, _ = tracing_attack(vit, token_statistics(vit, members.subset(others).images),
                            inside, outside, splits.val)
    assert abs(auc - 0.5) < 0.15


def test_attack_figures_read_the_low_false_positive_end_of_the_curve():
    members = torch.tensor([10.0, 9.0, 1.0, 0.5])
    non_members = torch.arange(100, dtype=torch.float32) / 100  # all below 1.0
    auc, tpr = attack_figures(members, non_members)
    assert tpr == 0.75  # three members above every non-member, at no false positive
    assert 0.75 < auc < 1.0
