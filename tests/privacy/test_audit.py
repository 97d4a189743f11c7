"""The privacy audit flags a pool or a model that gives training images away, and only that."""

import numpy as np
import pytest
import torch

from fedmitr_core.client.training import train_local
from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.privacy.audit import (
    audit_pool,
    balanced_members,
    embed_with,
    loss_attack_auc,
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
    assert abs(loss_attack_auc(untrained, members, non_members) - 0.5) < 0.1
    overfit = vit_factory(cfg.model, splits.spec)()
    client = parse_config({"local-epochs": 150, "local-shift": 0}).client
    train_local(overfit, members, client, torch.device("cpu"), seed=0)
    assert loss_attack_auc(overfit, members, non_members) > 0.8
