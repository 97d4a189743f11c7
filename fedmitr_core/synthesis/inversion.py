"""Model inversion of the client ensemble: sparse (FedMITR) or dense (DeepInversion).

``ModelInverter.synthesize`` optimises a batch of images from noise so that
the ensemble classifies them as the targets. With ``prune_at`` set, at those
fractions of the iterations the ``prune_ratio`` lowest-attention patches of
those still kept are dropped: they leave the token sequence (token-gather
forward) and stop receiving gradient. At the end the kept patches are ranked
by the ensemble's CLS attention: the top ``keep_ratio`` of them form H, the
rest of the kept patches L. Soft labels come from the kept tokens, the tokens
the images were optimised through; the student also sees only those.
"""

from __future__ import annotations

import torch

from fedmitr_core.config import InversionConfig
from fedmitr_core.data.datasets import DataSpec
from fedmitr_core.models.tokens import all_patch_indices
from fedmitr_core.progress import Emit, Progress
from fedmitr_core.runtime import autocast, check_finite
from fedmitr_core.server.ensemble import TeacherEnsemble
from fedmitr_core.synthesis.losses import InversionLoss
from fedmitr_core.synthesis.pool import SyntheticPool
from fedmitr_core.synthesis.prior import FrozenTokens, SynthesisPrior, masked_sums


def _mask_from_indices(keep_idx: torch.Tensor, num_patches: int) -> torch.Tensor:
    mask = torch.zeros(keep_idx.shape[0], num_patches, dtype=torch.bool, device=keep_idx.device)
    return mask.scatter_(1, keep_idx, True)


def _patch_to_pixel_mask(mask: torch.Tensor, grid: int, patch: int) -> torch.Tensor:
    m = mask.view(-1, 1, grid, grid).float()
    return m.repeat_interleave(patch, dim=2).repeat_interleave(patch, dim=3)


def prune_steps(prune_at: tuple[float, ...], iterations: int) -> list[int]:
    """The steps (1-based) at which sparse inversion prunes: each fraction of ``iterations``."""
    return sorted({max(1, int(round(f * iterations))) for f in prune_at})


class ModelInverter:
    """Synthesises images from the ensemble (DeepInversion-style optimisation).

    Parameters
    ----------
    ensemble
        The frozen client ensemble.
    settings
        The ``inv-*``, pruning and ranking keys (``InversionConfig``): Adam on the
        pixels (normalised space) for ``inv-iterations`` steps per batch against
        the task loss plus TV / l2 priors, a random roll of up to ``inv-jitter``
        pixels per step, horizontal flips where ``spec`` allows them. At the
        ``prune-at`` fractions of the iterations (sparse inversion only) the
        ``prune-ratio`` lowest-ranked still-kept patches are dropped; the top
        ``keep-ratio`` of the patches kept to the end form H. ``low-label``:
        q_L is the ensemble fed only L tokens (``low-tokens``) or p_E^T
        (``full-image``). ``pruned-patches``: ``blank`` sets pruned patches to 0
        (the dataset mean) and takes soft labels from the kept tokens; ``keep``
        leaves them as they were when pruned, and one dense forward over all
        patches gives the soft labels and the attention that ranks the kept
        patches into H (every other patch, pruned ones included, is L).
        ``token-ranking``: patches are pruned and split into H / L by the
        ensemble's CLS attention (``attention``, FedMITR) or by random scores
        (``random``, the ablation that shows what the attention contributes).
    spec
        The images' shape, and whether flipping them keeps the label.
    patch_size
        ViT patch size (to map pixels to tokens).
    sparse
        Prune patches while optimising (FedMITR) or not (DeepInversion).
    label_temperature
        T of the stored soft labels (the student's KD temperature).
    precision
        ``auto`` (bf16 autocast for the teachers' forwards on CUDA), ``fp32``
        or ``bf16``.
    prior
        Added to the loss (``None``: none; ``fedmitr_core.synthesis.prior``), read
        from the tokens each step's forward keeps.
    """

    def __init__(self, ensemble: TeacherEnsemble, settings: InversionConfig, spec: DataSpec,
                 patch_size: int, sparse: bool, label_temperature: float,
                 precision: str = "auto", prior: SynthesisPrior | None = None) -> None:
        self.ensemble = ensemble
        self.settings = settings
        self.image_shape = spec.image_shape
        self.patch = patch_size
        self.grid = spec.image_size // patch_size
        self.num_patches = self.grid * self.grid
        self.flip = settings.inv_flip and spec.hflip_ok
        self.prune_steps = prune_steps(settings.prune_at if sparse else (),
                                       settings.inv_iterations)
        self.loss = InversionLoss(settings.inv_tv, settings.inv_l2, settings.inv_objective)
        self.temperature = label_temperature
        self.precision = precision
        self.prior = prior

    @property
    def sparse(self) -> bool:
        """Whether patches are pruned during inversion."""
        return bool(self.prune_steps)

    def _patch_scores(self, weights: torch.Tensor, attn: torch.Tensor,
                      rng: torch.Generator) -> torch.Tensor:
        """Scores of the patches in ``attn`` (``(B, n)``) for pruning and ranking.

        The teachers' CLS attention weighted by ``weights`` (``(K, B)``, their share
        of each target class), or random scores for ``token_ranking="random"``.
        """
        patch_attn = attn[:, :, self.ensemble.num_prefix:].float()
        if self.settings.token_ranking == "random":
            return torch.rand(patch_attn.shape[1:], generator=rng).to(attn.device)
        return torch.einsum("kb,kbn->bn", weights, patch_attn)

    def _jitter(self, images: torch.Tensor, keep_idx: torch.Tensor,
                rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll / flip the images and remap the kept patch indices to where they moved."""
        rows, cols = keep_idx // self.grid, keep_idx % self.grid
        jitter = self.settings.inv_jitter
        if jitter > 0:
            dy, dx = (int(v) for v in torch.randint(-jitter, jitter + 1, (2,), generator=rng))
            images = torch.roll(images, shifts=(dy, dx), dims=(2, 3))
            rows = (rows + round(dy / self.patch)) % self.grid
            cols = (cols + round(dx / self.patch)) % self.grid
        if self.flip and bool(torch.rand(1, generator=rng) < 0.5):
            images = torch.flip(images, dims=(3,))
            cols = self.grid - 1 - cols
        return images, rows * self.grid + cols

    def synthesize(self, labels: torch.Tensor, rng: torch.Generator,
                   progress: Progress | None = None) -> SyntheticPool:
        """Invert one batch of target ``labels`` into a pool entry."""
        s = self.settings
        device = self.ensemble.device
        labels = labels.to(device)
        b = labels.shape[0]
        init = torch.randn((b, *self.image_shape), generator=rng)
        images = init.to(device).requires_grad_(True)
        opt = torch.optim.Adam([images], lr=s.inv_lr, betas=(s.inv_beta1, s.inv_beta2))
        keep_idx = all_patch_indices(b, self.num_patches, device)
        pixel_mask = torch.ones(b, 1, *self.image_shape[1:], device=device)
        weights = self.ensemble.target_weights(labels)  # (K, B)
        frozen: FrozenTokens | None = None
        for step in range(1, s.inv_iterations + 1):
            x, idx = self._jitter(images, keep_idx, rng)
            with autocast(device, self.precision):
                if self.prior is None:
                    logits, attn = self.ensemble.teacher_outputs(x, idx)
                else:
                    logits, attn, reduced = self.ensemble.teacher_outputs_layers(
                        x, idx, self.prior.reduce)
            mixture = self.ensemble.mixture(logits)
            loss, parts = self.loss(logits, mixture, weights, labels, images * pixel_mask)
            if self.prior is not None:
                prior_loss, prior_parts = self.prior(reduced, weights, frozen)
                loss, parts = loss + prior_loss, {**parts, **prior_parts}
            check_finite(loss, f"inversion step {step} of {s.inv_iterations}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            images.grad.mul_(pixel_mask)
            opt.step()
            if step in self.prune_steps:
                score = self._patch_scores(weights, attn, rng)
                n_keep = max(1, keep_idx.shape[1] - int(s.prune_ratio * keep_idx.shape[1]))
                order = score.argsort(dim=1, descending=True)
                if self.prior is not None and self.prior.reads_pruned:
                    frozen = self._freeze(images.detach(), keep_idx, order[:, n_keep:], frozen)
                keep_idx = torch.gather(keep_idx, 1, order[:, :n_keep]).sort(dim=1).values
                pixel_mask = _patch_to_pixel_mask(
                    _mask_from_indices(keep_idx, self.num_patches), self.grid, self.patch)
            if progress is not None:
                on_target = float((mixture.argmax(dim=1) == labels).float().mean())
                shown = {k: v for k, v in parts.items() if k in ("stats", "similarity")}
                progress.step(loss=float(loss.detach()), task=parts["task"], on_target=on_target,
                              tokens=keep_idx.shape[1], **shown)
        # Patches pruned during inversion were optimised only until they were pruned:
        # blank them (0 is the dataset mean in normalised space) or keep them as they are.
        final = images * pixel_mask if s.pruned_patches == "blank" else images
        return self._finish(final.detach(), labels, keep_idx, rng)

    @torch.no_grad()
    def _freeze(self, images: torch.Tensor, keep_idx: torch.Tensor, dropped: torch.Tensor,
                frozen: FrozenTokens | None) -> FrozenTokens:
        """``frozen`` plus the tokens about to be pruned (positions ``dropped`` of ``keep_idx``).

        One forward over the tokens kept until now reads their features in context.
        """
        mask = torch.zeros(keep_idx.shape, dtype=torch.bool, device=keep_idx.device)
        mask.scatter_(1, dropped, True)
        with autocast(images.device, self.precision):
            _, _, (first, second) = self.ensemble.teacher_outputs_layers(
                images, keep_idx, masked_sums(mask))
        count = dropped.numel()
        kept = mask.numel() - count
        if frozen is None:
            return FrozenTokens(first.float(), second.float(), count, kept)
        return FrozenTokens(frozen.first + first.float(), frozen.second + second.float(),
                            frozen.count + count, kept)

    @torch.no_grad()
    def _finish(self, images: torch.Tensor, labels: torch.Tensor, keep_idx: torch.Tensor,
                rng: torch.Generator) -> SyntheticPool:
        """Rank the kept patches by attention into H and L; label both."""
        dense = self.settings.pruned_patches == "keep"
        logits, attn = self.ensemble.teacher_outputs(images, None if dense else keep_idx)
        score = self._patch_scores(self.ensemble.target_weights(labels), attn, rng)
        if dense:  # the attention of the kept patches, in the order of keep_idx
            score = torch.gather(score, 1, keep_idx)
        n_kept = keep_idx.shape[1]
        n_high = max(1, int(round(self.settings.keep_ratio * n_kept)))
        ranked = torch.gather(keep_idx, 1, score.argsort(dim=1, descending=True))
        high_mask = _mask_from_indices(ranked[:, :n_high], self.num_patches)
        soft = self.ensemble.mixture(logits, self.temperature)
        low_idx = (~high_mask).nonzero()[:, 1].view(len(labels), -1) if dense \
            else ranked[:, n_high:].sort(dim=1).values
        if self.settings.low_label == "low-tokens" and low_idx.shape[1] > 0:
            low = self.ensemble.predict(images, self.temperature, keep_idx=low_idx)
        else:
            low = soft
        return SyntheticPool(
            images=images.cpu().clone(), labels=labels.cpu().clone(),
            high_mask=high_mask.cpu(),
            kept_mask=_mask_from_indices(keep_idx, self.num_patches).cpu(),
            soft_labels=soft.cpu(), low_labels=low.cpu(),
        )

    def synthesize_pool(self, num_images: int, batch_size: int, num_classes: int,
                        rng: torch.Generator, label: str, emit: Emit | None) -> SyntheticPool:
        """``num_images`` images with class-balanced targets, in batches."""
        labels = torch.arange(num_images) % num_classes
        labels = labels[torch.randperm(num_images, generator=rng)]
        batches = [labels[i: i + batch_size] for i in range(0, num_images, batch_size)]
        progress = Progress(label, self.settings.inv_iterations * len(batches), emit)
        return SyntheticPool.concat([self.synthesize(y, rng, progress) for y in batches])
