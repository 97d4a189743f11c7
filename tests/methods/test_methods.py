"""Every registered server method on one tiny teacher set: each must beat chance."""

from typing import get_args

import pytest
import torch

from fedmitr_core.client.training import simulate_clients
from fedmitr_core.config import MethodName, parse_config
from fedmitr_core.methods import METHODS, POOLS, ROUND_METHODS, ServerContext
from fedmitr_core.methods.base import RNG_STREAMS
from fedmitr_core.models.evaluate import accuracy
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.runtime import Seconds
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet

GENERATOR_METHODS = ("dense", "coboosting", "fedftg")


@pytest.fixture(scope="module")
def tiny_context(tiny):
    cfg = parse_config({**tiny, "local-epochs": 20, "syn-images": 60, "distill-epochs": 8,
                        "alpha": 1.0})
    splits, updates = simulate_clients(cfg, 3)
    models = []
    for u in updates:
        vit = vit_factory(cfg.model, splits.spec)()
        vit.load_state_dict(u.state)
        models.append(vit.eval())
    teachers = TeacherSet(models, torch.stack([torch.as_tensor(u.label_counts)
                                               for u in updates]).numpy(),
                          token_stats=[u.token_stats for u in updates])
    device = torch.device("cpu")
    ctx = ServerContext(teachers=teachers, ensemble=TeacherEnsemble(teachers, "class", "loop",
                                                                    device),
                        cfg=cfg, spec=splits.spec, device=device, real_train=splits.train)
    return ctx, splits


@pytest.fixture
def generator_budget(tiny):
    """The generator baselines need more student steps than the 8 of the tiny budget.

    And more generator rounds than 4: with the token-statistics prior in its loss, the
    FedFTG generator at 4 rounds left the student at 0.287 agreement from a 0.259 start
    (0.334 without the prior), at 8 rounds 0.404.
    """
    cfg = parse_config({**tiny, "local-epochs": 20, "alpha": 1.0, "syn-images": 120,
                        "distill-epochs": 30, "gen-rounds": 8})
    return lambda ctx: ServerContext(**{**ctx.__dict__, "cfg": cfg})


def test_every_method_has_a_pool_with_a_random_stream_of_its_own():
    assert set(POOLS) == set(METHODS) - {"fedavg"}
    assert set(POOLS.values()) == set(RNG_STREAMS)
    assert len(set(RNG_STREAMS.values())) == len(RNG_STREAMS)
    assert set(get_args(MethodName)) == set(METHODS) | ROUND_METHODS


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_method_beats_chance(tiny_context, generator_budget, name):
    ctx, splits = tiny_context
    if name in GENERATOR_METHODS:
        ctx = generator_budget(ctx)
    out = METHODS[name](ctx)
    acc = accuracy(out.model, splits.test, ctx.device)
    # Chance is 0.1; on 360 test images its standard deviation is 0.016, so 0.15 is
    # three of them above it.
    assert acc > 0.15, f"{name}: {acc:.3f} (chance is 0.1)"
    # The global model is the plain timm ViT the clients use.
    assert set(out.model.state_dict()) == set(ctx.new_vit().state_dict())


def _agreement(model, ensemble, images):
    from fedmitr_core.models.evaluate import predict_logits

    ens = predict_logits(lambda x: ensemble.predict(x), images, torch.device("cpu")).argmax(1)
    own = predict_logits(model, images, torch.device("cpu")).argmax(1)
    return float((own == ens).float().mean())


@pytest.mark.parametrize("name", GENERATOR_METHODS)
def test_generator_baselines_pull_the_fedavg_start_towards_the_ensemble(tiny_context,
                                                                       generator_budget, name):
    ctx, splits = tiny_context
    ctx = generator_budget(ctx)
    start = _agreement(METHODS["fedavg"](ctx).model, ctx.ensemble, splits.test.images)
    out = METHODS[name](ctx)
    assert _agreement(out.model, ctx.ensemble, splits.test.images) > start + 0.03
    assert out.details["pool-size"] == 120
    # Seeded by the run seed alone: the same call gives the same student.
    again = METHODS[name](ctx)
    assert all(torch.equal(a, b) for a, b in zip(out.model.state_dict().values(),
                                                 again.model.state_dict().values(),
                                                 strict=True))


def test_fedftg_fine_tunes_at_its_own_rate_whatever_distill_lr_says(tiny_context, tiny):
    ctx, _ = tiny_context
    budget = {**tiny, "syn-images": 16, "distill-epochs": 2, "gen-rounds": 2, "gen-steps": 2}

    def fedftg(**rates):
        cfg = parse_config({**budget, **rates})
        return METHODS["fedftg"](ServerContext(**{**ctx.__dict__, "cfg": cfg})).model.state_dict()

    base = fedftg(**{"distill-lr": 0.003, "fedftg-lr": 0.001})
    other_distill = fedftg(**{"distill-lr": 0.01, "fedftg-lr": 0.001})
    other_fedftg = fedftg(**{"distill-lr": 0.003, "fedftg-lr": 0.01})
    assert all(torch.equal(base[k], other_distill[k]) for k in base)
    assert not all(torch.equal(base[k], other_fedftg[k]) for k in base)


def test_kd_real_distils_on_the_real_training_images(tiny_context):
    ctx, splits = tiny_context
    out = METHODS["kd-real"](ctx)
    assert out.pool is None and out.details["train-images"] == len(splits.train)
    no_data = ServerContext(**{**ctx.__dict__, "real_train": None})
    with pytest.raises(ValueError, match="kd-real"):
        METHODS["kd-real"](no_data)


def test_fedmitr_under_bf16_autocast_runs_forwards_in_bf16_and_still_learns(tiny_context, tiny):
    # What `precision=auto` does on CUDA, forced here on CPU with `precision=bf16`.
    from fedmitr_core.runtime import uses_bf16

    ctx, splits = tiny_context
    assert uses_bf16(torch.device("cuda"), "auto") and not uses_bf16(ctx.device, "auto")
    cfg = parse_config({**tiny, "local-epochs": 20, "syn-images": 60, "distill-epochs": 8,
                        "alpha": 1.0, "precision": "bf16"})
    bf16_ctx = ServerContext(**{**ctx.__dict__, "cfg": cfg})
    seen = []
    hook = ctx.ensemble.models[0].head.register_forward_hook(
        lambda _m, _i, out: seen.append(out.dtype))
    try:
        out = METHODS["fedmitr"](bf16_ctx)
    finally:
        hook.remove()
    assert torch.bfloat16 in seen
    assert all(p.dtype == torch.float32 for p in out.model.parameters())
    assert accuracy(out.model, splits.test, ctx.device) > 0.15


def test_methods_with_the_same_inversion_share_one_pool_and_its_cost(tiny_context, tmp_path):
    ctx, _ = tiny_context
    alone = METHODS["fedmitr-sparse"](ctx)  # no state folder: inverts itself
    lines = []
    shared = ServerContext(**{**ctx.__dict__, "state_dir": tmp_path, "emit": lines.append})
    first = METHODS["fedmitr"](shared)
    second = METHODS["fedmitr-sparse"](shared)
    assert first.pool_file == second.pool_file and first.pool_file.is_file()
    # the pool's wall and CPU seconds count for the method that reads it back
    assert first.reused_seconds == Seconds()
    assert second.reused_seconds.wall > 0.0 and second.reused_seconds.cpu > 0.0
    assert sum("inversion step" in line for line in lines) > 0
    assert any("fedmitr-sparse: synthetic pool of 60 images read from" in line for line in lines)
    assert not any(line.startswith("fedmitr-sparse: sparse inversion") for line in lines)
    # Reading the pool back gives exactly the result of inverting it again.
    torch.testing.assert_close(second.pool.images, alone.pool.images)
    for a, b in zip(alone.model.state_dict().values(), second.model.state_dict().values(),
                    strict=True):
        torch.testing.assert_close(a, b)
    other = METHODS["deepinversion"](shared)
    assert other.pool_file != first.pool_file and other.reused_seconds == Seconds()


def test_a_method_can_fix_its_student_start_whatever_student_init_says(tiny_context, tiny):
    from fedmitr_core.methods.base import fedavg_state, make_student

    ctx, _ = tiny_context
    cfg = parse_config({**tiny, "student-init": "scratch"})
    scratch_ctx = ServerContext(**{**ctx.__dict__, "cfg": cfg})
    averaged = fedavg_state(ctx.teachers)
    fixed = make_student(scratch_ctx, init="fedavg").vit.state_dict()
    fresh = make_student(scratch_ctx).vit.state_dict()
    assert all(torch.equal(fixed[k], averaged[k]) for k in averaged)
    assert not torch.equal(fresh["head.weight"], averaged["head.weight"])
