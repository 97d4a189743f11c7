"""The one student trainer: live relabelling, checkpoints every N epochs' worth of steps."""

import numpy as np
import torch

from fedmitr_core.config import DistillConfig
from fedmitr_core.distill.trainer import LiveRelabel, StudentTrainer, TrainingSetup
from fedmitr_core.models.student import StudentViT
from fedmitr_core.models.vit import build_vit
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet


def _vit(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_vit("vit-micro", 10, 16, 1, 4).eval()


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


def _trainer(path, every, steps_per_epoch=3, total=12, wd=0.05):
    student = torch.nn.Linear(4, 2)
    setup = TrainingSetup(torch.device("cpu"), checkpoint=path, checkpoint_every=every)
    return StudentTrainer(student, DistillConfig(distill_weight_decay=wd), setup, total,
                          steps_per_epoch)


def test_trainer_checkpoints_every_n_epochs_worth_of_steps_and_resumes(tmp_path):
    rng = torch.Generator().manual_seed(0)
    path = tmp_path / "distill.pt"
    trainer = _trainer(path, every=2)
    saved = []
    for unit in range(1, 5):  # 4 units of 3 steps: epochs 1..4
        for _ in range(3):
            trainer.step(trainer.student(torch.randn(5, 4, generator=rng)).square().mean())
        saved.append(trainer.checkpoint_if_due(unit, rng, lambda: {"note": torch.tensor(7)}))
    assert saved == [False, True, False, True]
    again = _trainer(path, every=2)
    done, extra = again.resume(rng, "t")
    assert done == 4 and again.steps == 12 and int(extra["note"]) == 7
    for a, b in zip(again.student.parameters(), trainer.student.parameters(), strict=True):
        assert torch.equal(a, b)
    assert again.sched.last_epoch == trainer.sched.last_epoch
    assert _trainer(None, every=2).resume(rng, "t") == (0, {})
    assert not _trainer(path, every=0).checkpoint_if_due(4, rng)


def test_trainer_takes_its_weight_decay_from_the_config():
    assert _trainer(None, 0, wd=0.0).opt.param_groups[0]["weight_decay"] == 0.0
    assert _trainer(None, 0, wd=0.3).opt.param_groups[0]["weight_decay"] == 0.3
