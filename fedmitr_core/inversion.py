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

from dataclasses import dataclass

import torch

from fedmitr_core.config import FedMITRConfig
from fedmitr_core.ensemble import TeacherEnsemble
from fedmitr_core.losses import InversionLoss
from fedmitr_core.progress import Emit, Progress
from fedmitr_core.tokens import all_patch_indices
from fedmitr_core.training import autocast


@dataclass
class SyntheticPool:
    """Synthetic images with everything the student needs, on CPU.

    ``inverted_mask`` (B, N) marks the patches kept to the end of inversion
    (all of them for dense inversion; every row keeps the same number);
    ``high_mask`` the high-attention ones among them (H; kept and not high is
    L); ``soft_labels`` is p_E^T on the kept tokens and ``low_labels`` q_L^T.
    """

    def kept_indices(self) -> torch.Tensor | None:
        """Kept patch indices ``(B, n_kept)``, or None when every patch is kept."""
        if bool(self.inverted_mask.all()):
            return None
        return self.inverted_mask.nonzero()[:, 1].view(len(self), -1)

    images: torch.Tensor
    labels: torch.Tensor
    high_mask: torch.Tensor
    inverted_mask: torch.Tensor
    soft_labels: torch.Tensor
    low_labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def concat(pools: list[SyntheticPool]) -> SyntheticPool:
        """One pool from several batches (tensors copied, never aliased)."""
        return SyntheticPool(*(torch.cat([getattr(p, f) for p in pools]).clone()
                               for f in SyntheticPool.__dataclass_fields__))

    def on_target_rate(self) -> float:
        """Share of images the ensemble assigns to their target label."""
        return float((self.soft_labels.argmax(dim=1) == self.labels).float().mean())


def _mask_from_indices(keep_idx: torch.Tensor, num_patches: int) -> torch.Tensor:
    mask = torch.zeros(keep_idx.shape[0], num_patches, dtype=torch.bool, device=keep_idx.device)
    return mask.scatter_(1, keep_idx, True)


def _patch_to_pixel_mask(mask: torch.Tensor, grid: int, patch: int) -> torch.Tensor:
    m = mask.view(-1, 1, grid, grid).float()
    return m.repeat_interleave(patch, dim=2).repeat_interleave(patch, dim=3)


class ModelInverter:
    """Synthesises images from the ensemble (DeepInversion-style optimisation).

    Parameters
    ----------
    ensemble
        The frozen client ensemble.
    image_shape
        ``(C, H, W)`` of the images to synthesise.
    patch_size
        ViT patch size (to map pixels to tokens).
    iterations, lr, betas
        Adam on the pixels (normalised space), ``iterations`` steps per batch.
    loss
        Task loss plus TV / l2 priors.
    jitter
        Random roll of up to this many pixels per step.
    flip
        Random horizontal flips (only where the dataset allows).
    prune_at
        Fractions of ``iterations`` at which to prune; empty for dense inversion.
    prune_ratio
        Share of the still-kept patches dropped at each prune step.
    keep_ratio
        Share of the patches kept at the end that form H.
    temperature
        T of the stored soft labels.
    low_label
        ``low-tokens``: q_L is the ensemble fed only L tokens; ``full-image``:
        q_L = p_E^T(x).
    pruned_patches
        ``blank``: pruned patches are set to 0 (the dataset mean) and soft
        labels come from the kept tokens; ``keep``: they keep the values they
        had when pruned, and one dense forward over all patches gives the
        soft labels and the attention that ranks the kept patches into H
        (every other patch, pruned ones included, is L).
    token_ranking
        ``attention``: patches are pruned and split into H / L by the
        ensemble's CLS attention (FedMITR); ``random``: by random scores, the
        ablation that shows what the attention contributes.
    precision
        ``auto`` (bf16 autocast for the teachers' forwards on CUDA), ``fp32``
        or ``bf16``.
    """

    def __init__(self, ensemble: TeacherEnsemble, image_shape: tuple[int, int, int],
                 patch_size: int, iterations: int, lr: float, betas: tuple[float, float],
                 loss: InversionLoss, jitter: int, flip: bool, prune_at: tuple[float, ...],
                 prune_ratio: float, keep_ratio: float, temperature: float,
                 low_label: str, pruned_patches: str = "blank", precision: str = "auto",
                 token_ranking: str = "attention") -> None:
        self.ensemble = ensemble
        self.image_shape = image_shape
        self.patch = patch_size
        self.grid = image_shape[1] // patch_size
        self.num_patches = self.grid * self.grid
        self.iterations = iterations
        self.lr, self.betas = lr, betas
        self.loss = loss
        self.jitter, self.flip = jitter, flip
        self.prune_steps = sorted({max(1, int(round(f * iterations))) for f in prune_at})
        self.prune_ratio = prune_ratio
        self.keep_ratio = keep_ratio
        self.temperature = temperature
        self.low_label = low_label
        self.pruned_patches = pruned_patches
        self.precision = precision
        self.token_ranking = token_ranking

    @property
    def sparse(self) -> bool:
        """Whether patches are pruned during inversion."""
        return bool(self.prune_steps)

    def _patch_scores(self, weights: torch.Tensor, attn: torch.Tensor,
                      generator: torch.Generator) -> torch.Tensor:
        """Scores of the patches in ``attn`` (``(B, n)``) for pruning and ranking.

        The teachers' CLS attention weighted by ``weights`` (``(K, B)``, their share
        of each target class), or random scores for ``token_ranking="random"``.
        """
        patch_attn = attn[:, :, self.ensemble.num_prefix:].float()
        if self.token_ranking == "random":
            return torch.rand(patch_attn.shape[1:], generator=generator).to(attn.device)
        return torch.einsum("kb,kbn->bn", weights, patch_attn)

    def _jitter(self, images: torch.Tensor, keep_idx: torch.Tensor,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll / flip the images and remap the kept patch indices to where they moved."""
        rows, cols = keep_idx // self.grid, keep_idx % self.grid
        if self.jitter > 0:
            dy, dx = (int(v) for v in torch.randint(-self.jitter, self.jitter + 1, (2,),
                                                     generator=generator))
            images = torch.roll(images, shifts=(dy, dx), dims=(2, 3))
            rows = (rows + round(dy / self.patch)) % self.grid
            cols = (cols + round(dx / self.patch)) % self.grid
        if self.flip and bool(torch.rand(1, generator=generator) < 0.5):
            images = torch.flip(images, dims=(3,))
            cols = self.grid - 1 - cols
        return images, rows * self.grid + cols

    def synthesize(self, labels: torch.Tensor, generator: torch.Generator,
                   progress: Progress | None = None) -> SyntheticPool:
        """Invert one batch of target ``labels`` into a pool entry."""
        device = self.ensemble.device
        labels = labels.to(device)
        b = labels.shape[0]
        init = torch.randn((b, *self.image_shape), generator=generator)
        images = init.to(device).requires_grad_(True)
        opt = torch.optim.Adam([images], lr=self.lr, betas=self.betas)
        keep_idx = all_patch_indices(b, self.num_patches, device)
        pixel_mask = torch.ones(b, 1, *self.image_shape[1:], device=device)
        weights = self.ensemble.target_weights(labels)  # (K, B)
        for step in range(1, self.iterations + 1):
            x, idx = self._jitter(images, keep_idx, generator)
            with autocast(device, self.precision):
                logits, attn = self.ensemble.teacher_outputs(x, idx)
            mixture = self.ensemble.mixture(logits)
            loss, parts = self.loss(logits, mixture, weights, labels, images * pixel_mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            images.grad.mul_(pixel_mask)
            opt.step()
            if step in self.prune_steps:
                score = self._patch_scores(weights, attn, generator)
                n_keep = max(1, keep_idx.shape[1] - int(self.prune_ratio * keep_idx.shape[1]))
                order = score.argsort(dim=1, descending=True)[:, :n_keep]
                keep_idx = torch.gather(keep_idx, 1, order).sort(dim=1).values
                pixel_mask = _patch_to_pixel_mask(
                    _mask_from_indices(keep_idx, self.num_patches), self.grid, self.patch)
            if progress is not None:
                on_target = float((mixture.argmax(dim=1) == labels).float().mean())
                progress.step(loss=float(loss.detach()), task=parts["task"], on_target=on_target,
                              tokens=keep_idx.shape[1])
        # Patches pruned during inversion were optimised only until they were pruned:
        # blank them (0 is the dataset mean in normalised space) or keep them as they are.
        final = images * pixel_mask if self.pruned_patches == "blank" else images
        return self._finish(final.detach(), labels, keep_idx, generator)

    @torch.no_grad()
    def _finish(self, images: torch.Tensor, labels: torch.Tensor, keep_idx: torch.Tensor,
                generator: torch.Generator) -> SyntheticPool:
        """Rank the kept patches by attention into H and L; label both."""
        dense = self.pruned_patches == "keep"
        logits, attn = self.ensemble.teacher_outputs(images, None if dense else keep_idx)
        score = self._patch_scores(self.ensemble.target_weights(labels), attn, generator)
        if dense:  # the attention of the kept patches, in the order of keep_idx
            score = torch.gather(score, 1, keep_idx)
        n_kept = keep_idx.shape[1]
        n_high = max(1, int(round(self.keep_ratio * n_kept)))
        ranked = torch.gather(keep_idx, 1, score.argsort(dim=1, descending=True))
        high_mask = _mask_from_indices(ranked[:, :n_high], self.num_patches)
        soft = self.ensemble.mixture(logits, self.temperature)
        low_idx = (~high_mask).nonzero()[:, 1].view(len(labels), -1) if dense \
            else ranked[:, n_high:].sort(dim=1).values
        if self.low_label == "low-tokens" and low_idx.shape[1] > 0:
            low = self.ensemble.predict(images, self.temperature, keep_idx=low_idx)
        else:
            low = soft
        return SyntheticPool(
            images=images.cpu().clone(), labels=labels.cpu().clone(),
            high_mask=high_mask.cpu(),
            inverted_mask=_mask_from_indices(keep_idx, self.num_patches).cpu(),
            soft_labels=soft.cpu(), low_labels=low.cpu(),
        )

    def synthesize_pool(self, num_images: int, batch_size: int, num_classes: int,
                        generator: torch.Generator, label: str, emit: Emit | None
                        ) -> SyntheticPool:
        """``num_images`` images with class-balanced targets, in batches."""
        labels = torch.arange(num_images) % num_classes
        labels = labels[torch.randperm(num_images, generator=generator)]
        batches = [labels[i: i + batch_size] for i in range(0, num_images, batch_size)]
        progress = Progress(label, self.iterations * len(batches), emit)
        return SyntheticPool.concat([self.synthesize(y, generator, progress) for y in batches])


def build_inverter(ensemble: TeacherEnsemble, cfg: FedMITRConfig,
                   image_shape: tuple[int, int, int], hflip_ok: bool, sparse: bool
                   ) -> ModelInverter:
    """An inverter configured from the run config (sparse or dense)."""
    inv = cfg.inversion
    return ModelInverter(
        ensemble=ensemble, image_shape=image_shape, patch_size=cfg.model.patch_size,
        iterations=inv.inv_iterations, lr=inv.inv_lr, betas=(inv.inv_beta1, inv.inv_beta2),
        loss=InversionLoss(inv.inv_tv, inv.inv_l2, inv.inv_objective),
        jitter=inv.inv_jitter, flip=inv.inv_flip and hflip_ok,
        prune_at=inv.prune_at if sparse else (), prune_ratio=inv.prune_ratio,
        keep_ratio=inv.keep_ratio, temperature=cfg.distill.temperature,
        low_label=cfg.distill.low_label, pruned_patches=inv.pruned_patches,
        precision=cfg.server.precision, token_ranking=inv.token_ranking,
    )
