"""Inversion followed by student distillation: FedMITR, its ablations and DeepInversion.

They differ only in whether inversion is sparse and which loss terms the
student trains with; the pieces (inverter, loss, distillation loop) are shared.
"""

from __future__ import annotations

from fedmitr_core.distill import LiveRelabel, distill_student
from fedmitr_core.inversion import build_inverter
from fedmitr_core.losses import TokenRelabelLoss
from fedmitr_core.methods.base import MethodResult, ServerContext, ServerMethod, make_student


def inversion_distillation(name: str, sparse: bool, token_relabel: bool, salt: int
                           ) -> ServerMethod:
    """A server method: (sparse or dense) inversion, then KD (+ token relabelling)."""

    def run(ctx: ServerContext) -> MethodResult:
        cfg = ctx.cfg
        gen = ctx.generator(salt)
        inverter = build_inverter(ctx.ensemble, cfg, ctx.image_shape, ctx.hflip_ok, sparse)
        kind = "sparse" if sparse else "dense"
        pool = inverter.synthesize_pool(
            cfg.inversion.syn_images, cfg.inversion.syn_batch_size, ctx.num_classes, gen,
            label=f"{name}: {kind} inversion step", emit=ctx.emit,
        )
        d = cfg.distill
        loss = TokenRelabelLoss(
            kd_weight=d.kd_weight,
            hi_weight=d.hi_weight if token_relabel else 0.0,
            lo_weight=d.lo_weight if token_relabel else 0.0,
            temperature=d.temperature,
        )
        live = None
        if d.live_mix > 0 or d.live_shift > 0:
            live = LiveRelabel(ctx.ensemble, d.live_mix, d.live_shift, d.temperature,
                               d.kd_weight)
        student = distill_student(
            make_student(ctx), pool, loss, d.distill_epochs, d.distill_batch_size,
            d.distill_lr, ctx.device, gen, label=f"{name}: distillation epoch", emit=ctx.emit,
            live=live,
        )
        return MethodResult(model=student.vit, pool=pool,
                            details={"pool-on-target": pool.on_target_rate(),
                                     "pool-size": len(pool)})

    run.__name__ = f"run_{name.replace('-', '_')}"
    run.__doc__ = (f"{name}: {'sparse' if sparse else 'dense'} inversion, KD"
                   f"{' + token relabelling' if token_relabel else ''}.")
    return run


run_fedmitr = inversion_distillation("fedmitr", sparse=True, token_relabel=True, salt=1)
run_deepinversion = inversion_distillation("deepinversion", sparse=False, token_relabel=False,
                                           salt=2)
run_fedmitr_sparse = inversion_distillation("fedmitr-sparse", sparse=True,
                                            token_relabel=False, salt=1)
run_fedmitr_relabel = inversion_distillation("fedmitr-relabel", sparse=False,
                                             token_relabel=True, salt=2)
