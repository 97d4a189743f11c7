import numpy as np
import torch

from fedmitr_core.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.inversion import ModelInverter, SyntheticPool
from fedmitr_core.losses import InversionLoss
from fedmitr_core.models import build_vit


def _ensemble(k=3):
    models = []
    for i in range(k):
        torch.manual_seed(i)
        models.append(build_vit("vit-micro", 10, 16, 1, 4).eval())
    counts = np.full((k, 10), 5)
    return TeacherEnsemble(TeacherSet(models, counts), "class", "loop", torch.device("cpu"))


def _inverter(ens, prune_at, iterations=8, keep_ratio=0.5, low_label="low-tokens", lr=0.1,
              pruned_patches="blank", token_ranking="attention"):
    return ModelInverter(
        ensemble=ens, image_shape=(1, 16, 16), patch_size=4, iterations=iterations, lr=lr,
        betas=(0.5, 0.99), loss=InversionLoss(1e-4, 1e-5, "per-teacher"), jitter=1,
        flip=False, prune_at=prune_at, prune_ratio=0.3, keep_ratio=keep_ratio,
        temperature=3.0, low_label=low_label, pruned_patches=pruned_patches,
        token_ranking=token_ranking)


def test_sparse_inversion_prunes_the_expected_number_of_patches():
    ens = _ensemble()
    gen = torch.Generator().manual_seed(0)
    pool = _inverter(ens, (0.25, 0.5)).synthesize(torch.arange(6) % 10, gen)
    # 16 patches -> drop int(0.3*16)=4 -> 12 -> drop int(0.3*12)=3 -> 9.
    assert (pool.inverted_mask.sum(dim=1) == 9).all()
    # H: round(0.5 * 9) = 4 of the kept patches; never a pruned one.
    assert (pool.high_mask.sum(dim=1) == 4).all()
    assert not (pool.high_mask & ~pool.inverted_mask).any()
    assert pool.kept_indices().shape == (6, 9)
    # Pruned patches were blanked (never optimised), kept ones were not.
    pixels = pool.inverted_mask.view(6, 1, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3)
    assert (pool.images[~pixels] == 0).all()
    assert (pool.images[pixels] != 0).float().mean() > 0.9
    torch.testing.assert_close(pool.soft_labels.sum(dim=1), torch.ones(6))
    torch.testing.assert_close(pool.low_labels.sum(dim=1), torch.ones(6))


def _default_and_variant(ens, labels, **variant):
    """Two sparse inversions from the same seed: at the defaults and with ``variant``."""
    return tuple(_inverter(ens, (0.25, 0.5), **kwargs).synthesize(
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


def test_token_ranking_attention_puts_the_attended_patches_in_h_and_random_does_not():
    ens = _ensemble()
    labels = torch.arange(8) % 10
    by_attention, by_chance = _default_and_variant(ens, labels, token_ranking="random")
    assert _h_outranks_l(ens, by_attention, labels).all()
    assert not _h_outranks_l(ens, by_chance, labels).all()
    # Same counts either way; the random ranking prunes other patches.
    assert (by_chance.inverted_mask.sum(dim=1) == 9).all()
    assert (by_chance.high_mask.sum(dim=1) == 4).all()
    assert not torch.equal(by_chance.inverted_mask, by_attention.inverted_mask)


def test_sparse_inversion_can_keep_pruned_patches_and_label_them_low():
    ens = _ensemble()
    labels = torch.arange(6) % 10
    blank, kept = _default_and_variant(ens, labels, pruned_patches="keep")
    # Same optimisation, so the same patches were pruned; now they keep their values.
    assert torch.equal(kept.inverted_mask, blank.inverted_mask)
    pixels = kept.inverted_mask.view(6, 1, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3)
    torch.testing.assert_close(kept.images[pixels], blank.images[pixels])
    assert (kept.images[~pixels] != 0).float().mean() > 0.9
    # H is still 4 of the 9 kept patches; soft labels come from the whole image.
    assert (kept.high_mask.sum(dim=1) == 4).all()
    assert not (kept.high_mask & ~kept.inverted_mask).any()
    torch.testing.assert_close(kept.soft_labels, ens.predict(kept.images, 3.0))
    # q_L: the ensemble on the 12 patches outside H (pruned ones included).
    low_idx = (~kept.high_mask).nonzero()[:, 1].view(6, -1)
    assert low_idx.shape == (6, 12)
    torch.testing.assert_close(kept.low_labels, ens.predict(kept.images, 3.0, keep_idx=low_idx))


def test_dense_inversion_keeps_every_patch_and_lowers_the_loss():
    ens = _ensemble()
    labels = torch.arange(8) % 10
    gen = torch.Generator().manual_seed(0)
    inv = _inverter(ens, (), iterations=120, low_label="full-image", lr=0.25)
    pool = inv.synthesize(labels, gen)
    assert (pool.inverted_mask.sum(dim=1) == 16).all()
    torch.testing.assert_close(pool.low_labels, pool.soft_labels)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn((8, 1, 16, 16), generator=gen)
    before = (ens.predict(start).argmax(dim=1) == labels).float().mean()
    after = (ens.predict(pool.images).argmax(dim=1) == labels).float().mean()
    assert after >= before + 0.25
    assert pool.on_target_rate() == after


def test_pool_concat_copies_and_balances_labels():
    ens = _ensemble(2)
    inv = _inverter(ens, (0.5,), iterations=2)
    pool = inv.synthesize_pool(30, 12, 10, torch.Generator().manual_seed(1), "t", None)
    assert len(pool) == 30
    assert np.bincount(pool.labels.numpy(), minlength=10).tolist() == [3] * 10
    merged = SyntheticPool.concat([pool, pool])
    merged.images[0] += 1.0
    assert not torch.equal(merged.images[0], pool.images[0])
