"""The token-gather forward and the last block's CLS attention."""

import torch

from fedmitr_core.models.tokens import all_patch_indices, forward_gathered


def test_gather_forward_with_all_tokens_equals_plain_forward(micro_vit):
    vit = micro_vit(seed=0)
    x = torch.randn(4, 1, 16, 16)
    with torch.no_grad():
        plain = vit(x)
        gathered, _ = forward_gathered(vit, x, None)
        explicit, _ = forward_gathered(vit, x, all_patch_indices(4, 16, "cpu"))
    torch.testing.assert_close(gathered, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, plain, atol=1e-5, rtol=1e-5)


def test_attention_rows_sum_to_one_and_follow_kept_tokens(micro_vit):
    vit = micro_vit(seed=0)
    x = torch.randn(3, 1, 16, 16)
    keep = torch.tensor([[0, 5, 9, 15]] * 3)
    with torch.no_grad():
        logits, attn = forward_gathered(vit, x, keep)
        _, attn_all = forward_gathered(vit, x, None)
    assert attn.shape == (3, 1 + 4)
    torch.testing.assert_close(attn.sum(dim=1), torch.ones(3))
    torch.testing.assert_close(attn_all.sum(dim=1), torch.ones(3))
    assert (attn >= 0).all()
    # Dropping tokens changes the prediction (it is really a shorter sequence).
    assert not torch.allclose(logits, vit(x), atol=1e-4)


def test_gathering_is_independent_of_index_order(micro_vit):
    vit = micro_vit(seed=0)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        a, _ = forward_gathered(vit, x, torch.tensor([[1, 2, 3, 7]] * 2))
        b, _ = forward_gathered(vit, x, torch.tensor([[7, 3, 2, 1]] * 2))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
