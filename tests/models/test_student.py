"""The FedMITR student: CLS head for inference, a token head on every patch."""

import torch

from fedmitr_core.models.student import StudentViT


def test_student_token_head_covers_every_patch(micro_vit):
    student = StudentViT(micro_vit(seed=0))
    cls_logits, tok = student.forward_tokens(torch.randn(2, 1, 16, 16))
    assert cls_logits.shape == (2, 10) and tok.shape == (2, 16, 10)


def test_token_head_can_start_as_the_cls_head(micro_vit):
    vit = micro_vit(seed=0)
    copied = StudentViT(vit, token_head_from_cls=True)
    torch.testing.assert_close(copied.token_head.weight, vit.head.weight)
    torch.testing.assert_close(copied.token_head.bias, vit.head.bias)
    fresh = StudentViT(micro_vit(seed=0))
    assert not torch.allclose(fresh.token_head.weight, vit.head.weight)
