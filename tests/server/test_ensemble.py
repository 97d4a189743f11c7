"""The teacher ensemble: weights, teachers-per-class, the loop and vmap forms."""

import numpy as np
import pytest
import torch

from fedmitr_core.models.vit import build_vit
from fedmitr_core.server.ensemble import (
    TeacherEnsemble,
    TeacherSet,
    auto_form,
    class_weights,
    select_teachers,
)


def _vit(seed=0):
    torch.manual_seed(seed)
    return build_vit("vit-micro", 10, 16, 1, 4).eval()


def _teachers(k=4):
    counts = np.random.default_rng(0).integers(0, 20, size=(k, 10))
    counts[:, 0] += 1
    return TeacherSet([_vit(seed=i) for i in range(k)], counts)


@pytest.mark.parametrize("chunk_size", [32, 2, 3])  # one chunk; even chunks; a ragged last
def test_vmap_ensemble_equals_loop_ensemble(chunk_size):
    teachers = _teachers(5)
    loop = TeacherEnsemble(teachers, "class", "loop", torch.device("cpu"))
    vmap = TeacherEnsemble(teachers, "class", "vmap", torch.device("cpu"), chunk_size=chunk_size)
    x = torch.randn(5, 1, 16, 16)
    keep = torch.tensor([[0, 3, 4, 8, 12]] * 5)
    for idx in (None, keep):
        l_logits, l_attn = loop.teacher_outputs(x, idx)
        v_logits, v_attn = vmap.teacher_outputs(x, idx)
        assert v_logits.shape == (5, 5, 10)
        torch.testing.assert_close(v_logits, l_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_attn, l_attn, atol=1e-5, rtol=1e-5)
    # Gradients to the images (what inversion uses) agree too, chunks recomputed or not.
    grads = []
    for ens in (loop, vmap, TeacherEnsemble(teachers, "class", "loop", torch.device("cpu"),
                                            chunk_size=chunk_size)):
        img = x.clone().requires_grad_(True)
        logits, attn = ens.teacher_outputs(img, keep)
        (logits.square().sum() + attn.sum()).backward()
        grads.append(img.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[2], grads[0], atol=1e-5, rtol=1e-4)


def test_teachers_per_class_keeps_each_class_top_clients():
    # 5 clients, 3 classes (hand-made). Top holders per class:
    # class 0: clients 0 (9), 2 (5); class 1: 3 (8), 1 (6); class 2: 4 (7), then 0 and 2
    # tie at 3: the lower index (0) is kept.
    counts = np.array([[9, 0, 3], [1, 6, 0], [5, 2, 3], [0, 8, 1], [0, 1, 7]])
    teachers = TeacherSet([_vit(seed=i) for i in range(5)], np.pad(counts, ((0, 0), (0, 7))),
                          client_ids=[f"c{i}" for i in range(5)])
    assert select_teachers(teachers, 2).client_ids == ["c0", "c1", "c2", "c3", "c4"]
    one = select_teachers(teachers, 1)
    assert one.client_ids == ["c0", "c3", "c4"]
    assert one.models[1] is teachers.models[3]
    # The kept teachers keep their counts: class weighting runs over the kept set.
    assert one.label_counts[:, :3].tolist() == [[9, 0, 3], [0, 8, 1], [0, 1, 7]]
    w = class_weights(one.label_counts)[:, :3]
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 3 / 11], [0.0, 8 / 9, 1 / 11],
                                                [0.0, 1 / 9, 7 / 11]]))
    assert select_teachers(teachers, 0) is teachers


def test_auto_form_is_decided_by_the_device():
    assert auto_form(torch.device("cpu")) == "loop"
    assert auto_form(torch.device("cuda")) == "vmap"
    ens = TeacherEnsemble(_teachers(2), "samples", "auto", torch.device("cpu"))
    assert ens.form == "loop"


def test_class_weights_and_mixtures():
    counts = np.array([[10, 0, 5], [0, 10, 5]])
    w = class_weights(counts)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5]]))
    teachers = TeacherSet([_vit(0), _vit(1)], np.pad(counts, ((0, 0), (0, 7))))
    ens = TeacherEnsemble(teachers, "class", "loop", torch.device("cpu"))
    logits = torch.randn(2, 3, 10)
    for weighting in ("uniform", "samples", "class"):
        ens.weighting = weighting
        probs = ens.mixture(logits)
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(3))
    # Class weighting: class 0 comes only from teacher 0.
    ens.weighting = "class"
    logits = torch.zeros(2, 1, 10)
    logits[0, 0, 0] = 5.0  # teacher 0 confident in class 0
    logits[1, 0, 1] = 5.0  # teacher 1 confident in class 1
    mixed = ens.mixture(logits)
    assert mixed[0, 0] > mixed[0, 2] and mixed[0, 1] > mixed[0, 2]
