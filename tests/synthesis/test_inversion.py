"""Model inversion, sparse and dense, and the pool it fills."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedmitr_core.config import InversionConfig
from fedmitr_core.data.datasets import DataSpec
from fedmitr_core.synthesis.inversion import ModelInverter
from fedmitr_core.synthesis.pool import SyntheticPool

SPEC = DataSpec(10, 16, 1, (0.0,), (1.0,), tuple(map(str, range(10))))
SETTINGS = InversionConfig(inv_iterations=8, inv_lr=0.1, inv_tv=1e-4, prune_at=(0.25, 0.5))


@pytest.fixture
def ens(micro_ensemble):
    return micro_ensemble()


def _inverter(ens, sparse=True, **settings):
    return ModelInverter(ens, replace(SETTINGS, **settings), SPEC, patch_size=4, sparse=sparse,
                         label_temperature=3.0)


def test_sparse_inversion_prunes_the_expected_number_of_patches(ens):
    gen = torch.Generator().manual_seed(0)
    pool = _inverter(ens).synthesize(torch.arange(6) % 10, gen)
    # 16 patches -> drop int(0.3*16)=4 -> 12 -> drop int(0.3*12)=3 -> 9.
    assert (pool.kept_mask.sum(dim=1) == 9).all()
    # H: round(0.5 * 9) = 4 of the kept patches; never a pruned one.
    assert (pool.high_mask.sum(dim=1) == 4).all()
    assert not (pool.high_mask & ~pool.kept_mask).any()
    assert pool.kept_indices().shape == (6, 9)
    # Pruned patches were blanked (never optimised), kept ones were not.
    pixels = pool.kept_mask.view(6, 1, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3)
    assert (pool.images[~pixels] == 0).all()
    assert (pool.images[pixels] != 0).float().mean() > 0.9
    torch.testing.assert_close(pool.soft_labels.sum(dim=1), torch.ones(6))
    torch.testing.assert_close(pool.low_labels.sum(dim=1), torch.ones(6))


def _default_and_variant(ens, labels, **variant):
    """Two sparse inversions from the same seed: at the defaults and with ``variant``."""
    return tuple(_inverter(ens, **kwargs).synthesize(
        labels, torch.Generator().manual_seed(0)) for kwargs in ({}, variant))


def _h_outranks_l(ens, pool, labels):
    """Per image: whether every H patch has more target-weighted attention than every L one."""
    keep = pool.kept_indices()
    _, attn = ens.teacher_outputs(pool.images, keep)
    score = torch.einsum("kb,kbn->bn", ens.target_weights(labels), attn[:, :, ens.num_prefix:])
    high = torch.gather(pool.high_mask, 1, keep)
    worst_high = score.masked_fill(~high, float("inf")).min(dim=1).values
    best_low = score.masked_fill(high, float("-inf")).max(dim=1).values
    return worst_high > best_low


def test_token_ranking_attention_puts_the_attended_patches_in_h_and_random_does_not(ens):
    labels = torch.arange(8) % 10
    by_attention, by_chance = _default_and_variant(ens, labels, token_ranking="random")
    assert _h_outranks_l(ens, by_attention, labels).all()
    assert not _h_outranks_l(ens, by_chance, labels).all()
    # Same counts either way; the random ranking prunes other patches.
    assert (by_chance.kept_mask.sum(dim=1) == 9).all()
    assert (by_chance.high_mask.sum(dim=1) == 4).all()
    assert not torch.equal(by_chance.kept_mask, by_attention.kept_mask)


def test_sparse_inversion_can_keep_pruned_patches_and_label_them_low(ens):
    labels = torch.arange(6) % 10
    blank, kept = _default_and_variant(ens, labels, pruned_patches="keep")
    # Same optimisation, so the same patches were pruned; now they keep their values.
    assert torch.equal(kept.kept_mask, blank.kept_mask)
    pixels = kept.kept_mask.view(6, 1, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3)
    torch.testing.assert_close(kept.images[pixels], blank.images[pixels])
    assert (kept.images[~pixels] != 0).float().mean() > 0.9
    # H is still 4 of the 9 kept patches; soft labels come from the whole image.
    assert (kept.high_mask.sum(dim=1) == 4).all()
    assert not (kept.high_mask & ~kept.kept_mask).any()
    torch.testing.assert_close(kept.soft_labels, ens.predict(kept.images, 3.0))
    # q_L: the ensemble on the 12 patches outside H (pruned ones included).
    low_idx = (~kept.high_mask).nonzero()[:, 1].view(6, -1)
    assert low_idx.shape == (6, 12)
    torch.testing.assert_close(kept.low_labels, ens.predict(kept.images, 3.0, keep_idx=low_idx))


def test_dense_inversion_keeps_every_patch_and_lowers_the_loss(ens):
    labels = torch.arange(8) % 10
    gen = torch.Generator().manual_seed(0)
    inv = _inverter(ens, sparse=False, inv_iterations=120, low_label="full-image", inv_lr=0.25)
    pool = inv.synthesize(labels, gen)
    assert (pool.kept_mask.sum(dim=1) == 16).all()
    torch.testing.assert_close(pool.low_labels, pool.soft_labels)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn((8, 1, 16, 16), generator=gen)
    before = (ens.predict(start).argmax(dim=1) == labels).float().mean()
    after = (ens.predict(pool.images).argmax(dim=1) == labels).float().mean()
    assert after >= before + 0.25
    assert pool.on_target_rate() == after


def test_pool_concat_copies_and_balances_labels(micro_ensemble):
    ens = micro_ensemble(k=2)
    inv = _inverter(ens, prune_at=(0.5,), inv_iterations=2)
    pool = inv.synthesize_pool(30, 12, 10, torch.Generator().manual_seed(1), "t", None)
    assert len(pool) == 30
    assert np.bincount(pool.labels.numpy(), minlength=10).tolist() == [3] * 10
    merged = SyntheticPool.concat([pool, pool])
    merged.images[0] += 1.0
    assert not torch.equal(merged.images[0], pool.images[0])
