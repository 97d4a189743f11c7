"""The one student trainer: live relabelling, checkpoints every N epochs' worth of steps."""

import numpy as np
import torch

from fedmitr_core.config import DistillConfig
from fedmitr_core.distill.losses import TokenRelabelLoss
from fedmitr_core.distill.trainer import LiveRelabel, StudentTrainer, TrainingSetup, train_on_pool
from fedmitr_core.models.student import StudentViT
from fedmitr_core.models.vit import build_vit
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.synthesis.pool import SyntheticPool


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


class _CountingEnsemble(TeacherEnsemble):
    """The real ensemble, counting the batches it labels."""

    calls = 0

    def predict(self, images, temperature=1.0, keep_idx=None):
        self.calls += 1
        return super().predict(images, temperature, keep_idx)


def test_live_relabelling_runs_on_every_nth_student_step_only():
    n, tokens = 8, 16
    pool = SyntheticPool(images=torch.randn(n, 1, 16, 16), labels=torch.arange(n) % 10,
                         high_mask=torch.zeros(n, tokens, dtype=torch.bool),
                         kept_mask=torch.ones(n, tokens, dtype=torch.bool),
                         soft_labels=torch.full((n, 10), 0.1), low_labels=torch.full((n, 10), 0.1))
    loss = TokenRelabelLoss(kd_weight=1.0, hi_weight=0.0, lo_weight=0.0, temperature=3.0)
    calls = {}
    for every in (1, 3):
        ens = _CountingEnsemble(TeacherSet([_vit(1), _vit(2)], np.full((2, 10), 3)), "class",
                                "loop", torch.device("cpu"))
        settings = DistillConfig(distill_epochs=2, distill_batch_size=2, live_every=every)
        train_on_pool(StudentViT(_vit(3)), pool, loss, settings,
                      TrainingSetup(torch.device("cpu")), torch.Generator().manual_seed(0), "t",
                      live=LiveRelabel(ens, 1.0, 2, 3.0, 1.0))
        calls[every] = ens.calls
    assert calls == {1: 8, 3: 3}  # 8 steps: all of them, or steps 0, 3 and 6


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
