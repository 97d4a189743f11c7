"""Student-side pieces: the H-term agreement filter, the token head, live relabelling."""

import numpy as np
import torch

from fedmitr_core.distill import LiveRelabel
from fedmitr_core.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.losses import TokenRelabelLoss
from fedmitr_core.models import StudentViT, build_vit


def _vit(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_vit("vit-micro", 10, 16, 1, 4).eval()


def test_agreed_only_drops_the_h_term_of_images_the_ensemble_puts_elsewhere():
    labels = torch.tensor([1, 2])
    soft = torch.tensor([[0.1, 0.8, 0.1] + [0.0] * 7,   # agrees with label 1
                         [0.9, 0.05, 0.05] + [0.0] * 7])  # says 0, label is 2
    tok = torch.zeros(2, 4, 10)
    tok[0, :, 1] = 50.0  # image 0: H tokens sure of its label -> CE ~ 0
    tok[1, :, 0] = 50.0  # image 1: H tokens sure of class 0 -> CE ~ 50 against label 2
    high = torch.tensor([[True, True, False, False]] * 2)
    cls = torch.zeros(2, 10)
    plain = TokenRelabelLoss(1.0, 1.0, 0.0, 3.0)
    agreed = TokenRelabelLoss(1.0, 1.0, 0.0, 3.0, hi_agreed_only=True)
    _, p = plain(cls, tok, soft, labels, high, soft)
    _, a = agreed(cls, tok, soft, labels, high, soft)
    assert p["hi"] > 20.0  # image 1's H tokens count
    assert a["hi"] < 1e-3  # only image 0 counts


def test_token_head_can_start_as_the_cls_head():
    vit = _vit(0)
    copied = StudentViT(vit, token_head_from_cls=True)
    torch.testing.assert_close(copied.token_head.weight, vit.head.weight)
    torch.testing.assert_close(copied.token_head.bias, vit.head.bias)
    fresh = StudentViT(_vit(0))
    assert not torch.allclose(fresh.token_head.weight, vit.head.weight)


def test_live_relabel_on_kept_tokens_ignores_the_pruned_patches():
    teachers = TeacherSet([_vit(1), _vit(2)], np.full((2, 10), 3))
    ens = TeacherEnsemble(teachers, "class", "loop", torch.device("cpu"))
    live = LiveRelabel(ens, mix_prob=0.0, max_shift=0, temperature=3.0, weight=1.0)
    student = StudentViT(_vit(3))
    x = torch.randn(2, 1, 16, 16)
    keep = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]] * 2)  # the top half of the patch grid
    changed = x.clone()
    changed[:, :, 8:] = torch.randn(2, 1, 8, 16)  # only pixels of pruned patches change
    gen = torch.Generator()
    with torch.no_grad():
        kept_a = live.loss(student, x, gen.manual_seed(0), keep)
        kept_b = live.loss(student, changed, gen.manual_seed(0), keep)
        full_a = live.loss(student, x, gen.manual_seed(0))
        full_b = live.loss(student, changed, gen.manual_seed(0))
    torch.testing.assert_close(kept_a, kept_b)
    assert not torch.allclose(full_a, full_b)
