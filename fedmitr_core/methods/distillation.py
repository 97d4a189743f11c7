"""Inversion followed by student distillation: FedMITR, its ablations and DeepInversion.

They differ only in whether inversion is sparse and which loss terms the
student trains with; the pieces (inverter, loss, distillation loop) are shared.
"""

from __future__ import annotations

import time

import torch

from fedmitr_core.checkpoint import CHECKPOINT_FILE, load_pool, save_pool
from fedmitr_core.distill import LiveRelabel, distill_student
from fedmitr_core.inversion import SyntheticPool, build_inverter
from fedmitr_core.losses import TokenRelabelLoss
from fedmitr_core.methods.base import MethodResult, ServerContext, ServerMethod, make_student
from fedmitr_core.training import predict_logits


def inversion_distillation(name: str, sparse: bool, token_relabel: bool, salt: int
                           ) -> ServerMethod:
    """A server method: (sparse or dense) inversion, then KD (+ token relabelling)."""

    def run(ctx: ServerContext) -> MethodResult:
        cfg = ctx.cfg
        gen = ctx.generator(salt)
        kind = "sparse" if sparse else "dense"
        # fedmitr / fedmitr-sparse and deepinversion / fedmitr-relabel invert alike
        # (same kind, same salt): the pool is made once and its seconds counted for both.
        pool_file = ctx.pool_file(f"{kind}-inversion-{salt}")
        reused = 0.0
        if pool_file is not None and pool_file.is_file():
            pool, reused = load_pool(pool_file, gen)
            if ctx.emit is not None:
                ctx.emit(f"{name}: synthetic pool of {len(pool)} images read from {pool_file} "
                         f"(made in {reused:.1f} s)")
        else:
            start = time.perf_counter()
            inverter = build_inverter(ctx.ensemble, cfg, ctx.image_shape, ctx.hflip_ok, sparse)
            pool = inverter.synthesize_pool(
                cfg.inversion.syn_images, cfg.inversion.syn_batch_size, ctx.num_classes, gen,
                label=f"{name}: {kind} inversion step", emit=ctx.emit,
            )
            if pool_file is not None:
                save_pool(pool_file, pool, gen, time.perf_counter() - start)
        result = distill_on_pool(ctx, name, pool, gen, token_relabel)
        result.pool_file, result.reused_seconds = pool_file, reused
        return result

    run.__name__ = f"run_{name.replace('-', '_')}"
    run.__doc__ = (f"{name}: {'sparse' if sparse else 'dense'} inversion, KD"
                   f"{' + token relabelling' if token_relabel else ''}.")
    return run


def distill_on_pool(ctx: ServerContext, name: str, pool: SyntheticPool,
                    gen: torch.Generator, token_relabel: bool) -> MethodResult:
    """The shared student training: KD (+ token relabelling) on ``pool``, live relabelling."""
    d = ctx.cfg.distill
    folder = ctx.method_state(name)
    loss = TokenRelabelLoss(
        kd_weight=d.kd_weight,
        hi_weight=d.hi_weight if token_relabel else 0.0,
        lo_weight=d.lo_weight if token_relabel else 0.0,
        temperature=d.temperature, hi_agreed_only=d.hi_agreed_only,
    )
    live = None
    if d.live_mix > 0 or d.live_shift > 0:
        live = LiveRelabel(ctx.ensemble, d.live_mix, d.live_shift, d.temperature,
                           d.kd_weight)
    student = distill_student(
        make_student(ctx), pool, loss, d.distill_epochs, d.distill_batch_size,
        d.distill_lr, ctx.device, gen, label=f"{name}: distillation epoch", emit=ctx.emit,
        live=live, kept_tokens_only=d.student_tokens != "all",
        live_kept_tokens=d.student_tokens == "kept-live",
        checkpoint=None if folder is None else folder / CHECKPOINT_FILE,
        checkpoint_every=ctx.cfg.server.checkpoint_every, precision=ctx.cfg.server.precision,
    )
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
                         inverted_mask=every.clone(), soft_labels=soft, low_labels=soft.clone())
    result = distill_on_pool(ctx, "kd-real", pool, ctx.generator(3), token_relabel=False)
    # The real images are not a synthetic pool: nothing of them is kept with the result.
    return MethodResult(model=result.model, details={"train-images": len(pool)})


run_fedmitr = inversion_distillation("fedmitr", sparse=True, token_relabel=True, salt=1)
run_deepinversion = inversion_distillation("deepinversion", sparse=False, token_relabel=False,
                                           salt=2)
run_fedmitr_sparse = inversion_distillation("fedmitr-sparse", sparse=True,
                                            token_relabel=False, salt=1)
run_fedmitr_relabel = inversion_distillation("fedmitr-relabel", sparse=False,
                                             token_relabel=True, salt=2)
