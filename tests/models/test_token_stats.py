"""Token statistics: what a client reports, and the per-batch moments inversion matches."""

import pytest
import torch

from fedmitr_core.models.token_stats import prior_layers, stats_shape, token_statistics
from fedmitr_core.models.tokens import embed_patches, forward_gathered, forward_gathered_stats


def test_batched_statistics_equal_one_pass_over_every_image(micro_vit):
    vit = micro_vit(seed=0)
    images = torch.randn(37, 1, 16, 16)
    stats = token_statistics(vit, images, batch_size=8)  # 5 uneven batches
    with torch.no_grad():
        _, _, mean, var = forward_gathered_stats(vit, images)
    assert stats.mean.shape == stats.var.shape == stats_shape(vit) == (len(vit.blocks) + 1,
                                                                        vit.embed_dim)
    assert stats.num_images == 37
    torch.testing.assert_close(stats.mean, mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats.var, var, atol=1e-5, rtol=1e-4)
    # Layer 0 is the embedding: the moments of the embedded patch tokens themselves.
    with torch.no_grad():
        tokens = embed_patches(vit, images)[:, vit.num_prefix_tokens:].flatten(0, 1)
    torch.testing.assert_close(stats.mean[0], tokens.mean(0), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats.var[0], tokens.var(0, unbiased=False), atol=1e-5,
                               rtol=1e-4)


def test_moments_under_the_gather_forward_are_those_of_the_kept_tokens(micro_vit):
    vit = micro_vit(seed=0)
    x = torch.randn(3, 1, 16, 16)
    keep = torch.tensor([[0, 5, 9, 15], [1, 2, 3, 4], [6, 7, 8, 10]])
    with torch.no_grad():
        logits, attn, mean, var = forward_gathered_stats(vit, x, keep)
        plain_logits, plain_attn = forward_gathered(vit, x, keep)
        tokens = embed_patches(vit, x)[:, vit.num_prefix_tokens:]
    kept = torch.gather(tokens, 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))
    torch.testing.assert_close(mean[0], kept.flatten(0, 1).mean(0))
    torch.testing.assert_close(var[0], kept.flatten(0, 1).var(0, unbiased=False))
    all_mean = forward_gathered_stats(vit, x)[2]
    assert not torch.allclose(mean[0], all_mean[0])  # pruned tokens are left out
    torch.testing.assert_close(logits, plain_logits)  # the same forward otherwise
    torch.testing.assert_close(attn, plain_attn)


def test_the_moments_carry_gradient_to_the_images(micro_vit):
    vit = micro_vit(seed=0)
    x = torch.randn(2, 1, 16, 16, requires_grad=True)
    _, _, mean, var = forward_gathered_stats(vit, x)
    (mean[2].sum() + var[2].sum()).backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0


@pytest.mark.parametrize(("spec", "expected"), [
    ("all-but-last", [0, 1]), ("all", [0, 1, 2]), ("2, 0", [0, 2]), ("1", [1])])
def test_prior_layers_by_name_or_index(spec, expected):
    assert prior_layers(spec, depth=2) == expected


@pytest.mark.parametrize(("spec", "match"), [("3", "layer 3 does not exist"),
                                             ("first", "feature-stats-layers")])
def test_prior_layers_that_do_not_exist_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        prior_layers(spec, depth=2)
