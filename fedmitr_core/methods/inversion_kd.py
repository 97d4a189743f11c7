"""Inversion followed by student distillation: FedMITR, its ablations and DeepInversion.

They differ only in whether inversion is sparse and which loss terms the
student trains with; the pieces (inverter, loss, the student trainer) are shared.
"""

from __future__ import annotations

import torch

from fedmitr_core.distill.losses import TokenRelabelLoss
from fedmitr_core.distill.trainer import LiveRelabel, train_on_pool
from fedmitr_core.methods.base import (
    MethodResult,
    ServerContext,
    ServerMethod,
    make_student,
    training_setup,
)
from fedmitr_core.models.evaluate import predict_logits
from fedmitr_core.runtime import Seconds, Stopwatch
from fedmitr_core.server.state import load_pool, save_pool
from fedmitr_core.synthesis.inversion import ModelInverter
from fedmitr_core.synthesis.pool import SyntheticPool
from fedmitr_core.synthesis.prior import synthesis_prior


def inversion_pool(ctx: ServerContext, name: str, sparse: bool, rng: torch.Generator
                   ) -> tuple[SyntheticPool, Seconds]:
    """The pool method ``name`` distils from, and the seconds an earlier method spent on it.

    Read back when a method that shares it (``POOLS``) made it; inverted otherwise.
    """
    pool_file = ctx.pool_file(name)
    if pool_file is not None and pool_file.is_file():
        pool, reused = load_pool(pool_file, rng)
        if ctx.emit is not None:
            ctx.emit(f"{name}: synthetic pool of {len(pool)} images read from {pool_file} "
                     f"(made in {reused.wall:.1f} s)")
        return pool, reused
    watch = Stopwatch()
    cfg = ctx.cfg
    inverter = ModelInverter(ctx.ensemble, cfg.inversion, ctx.spec, cfg.model.patch_size,
                             sparse=sparse, label_temperature=cfg.distill.temperature,
                             precision=cfg.runtime.precision,
                             prior=synthesis_prior(ctx.ensemble, cfg.prior,
                                               cfg.prior.feature_stats_weight))
    kind = "sparse" if sparse else "dense"
    pool = inverter.synthesize_pool(cfg.inversion.syn_images, cfg.inversion.syn_batch_size,
                                    ctx.spec.num_classes, rng,
                                    label=f"{name}: {kind} inversion step", emit=ctx.emit)
    if pool_file is not None:
        save_pool(pool_file, pool, rng, watch.elapsed())
    return pool, Seconds()


def inversion_distillation(name: str, sparse: bool, token_relabel: bool) -> ServerMethod:
    """A server method: (sparse or dense) inversion, then KD (+ token relabelling)."""

    def run(ctx: ServerContext) -> MethodResult:
        rng = ctx.rng(name)
        pool, reused = inversion_pool(ctx, name, sparse, rng)
        result = distill_on_pool(ctx, name, pool, rng, token_relabel)
        result.pool_file, result.reused_seconds = ctx.pool_file(name), reused
        return result

    run.__name__ = f"run_{name.replace('-', '_')}"
    run.__doc__ = (f"{name}: {'sparse' if sparse else 'dense'} inversion, KD"
                   f"{' + token relabelling' if token_relabel else ''}.")
    return run


def distill_on_pool(ctx: ServerContext, name: str, pool: SyntheticPool,
                    rng: torch.Generator, token_relabel: bool) -> MethodResult:
    """The shared student training: KD (+ token relabelling) on ``pool``, live relabelling."""
    d = ctx.cfg.distill
    loss = TokenRelabelLoss(
        kd_weight=d.kd_weight,
        hi_weight=d.hi_weight if token_relabel else 0.0,
        lo_weight=d.lo_weight if token_relabel else 0.0,
        temperature=d.temperature, hi_agreed_only=d.hi_agreed_only,
    )
    live = None
    if d.live_mix > 0 or d.live_shift > 0:
        live = LiveRelabel(ctx.ensemble, d.live_mix, d.live_shift, d.temperature, d.kd_weight)
    student = train_on_pool(make_student(ctx), pool, loss, d, training_setup(ctx, name), rng,
                            label=f"{name}: distillation epoch", live=live)
    return MethodResult(model=student.vit, pool=pool,
                        details={"pool-on-target": pool.on_target_rate(),
                                 "pool-size": len(pool)})


def run_kd_real(ctx: ServerContext) -> MethodResult:
    """Oracle reference: the same student and KD, on the *real* training images.

    No one-shot server has these images; the row separates what the teachers
    know from what the synthetic pool carries of it.
    """
    if ctx.real_train is None:
        raise ValueError("method 'kd-real' needs the real training split (an oracle reference)")
    images, labels = ctx.real_train.images, ctx.real_train.labels
    soft = predict_logits(lambda x: ctx.ensemble.predict(x, ctx.cfg.distill.temperature),
                          images, ctx.ensemble.device)
    every = torch.ones(len(labels), ctx.ensemble.num_patches, dtype=torch.bool)
    pool = SyntheticPool(images=images.clone(), labels=labels.clone(), high_mask=every,
                         kept_mask=every.clone(), soft_labels=soft, low_labels=soft.clone())
    result = distill_on_pool(ctx, "kd-real", pool, ctx.rng("kd-real"), token_relabel=False)
    # The real images are not a synthetic pool: nothing of them is kept with the result.
    return MethodResult(model=result.model, details={"train-images": len(pool)})


run_fedmitr = inversion_distillation("fedmitr", sparse=True, token_relabel=True)
run_deepinversion = inversion_distillation("deepinversion", sparse=False, token_relabel=False)
run_fedmitr_sparse = inversion_distillation("fedmitr-sparse", sparse=True, token_relabel=False)
run_fedmitr_relabel = inversion_distillation("fedmitr-relabel", sparse=False, token_relabel=True)
