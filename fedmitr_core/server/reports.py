"""Outputs of a run: metrics.json, report.md, config.yaml and pictures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fedmitr_core.server.state import atomic_write
from fedmitr_core.synthesis.pool import SyntheticPool


def results_table(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table: one row per method or reference.

    ``server seconds`` is wall-clock time, ``CPU seconds`` the server process's
    CPU time (``-`` where the work ran elsewhere, as in ``fedavg-rounds``).
    """
    lines = ["| method | test accuracy | val accuracy | server seconds | CPU seconds |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        cpu = r.get("cpu-seconds")
        times = f"{r['seconds']:.1f} | " + (f"{cpu:.1f}" if cpu is not None else "-")
        if "error" in r:
            lines.append(f"| {name} | failed | - | {times} |")
            continue
        val = r.get("val-accuracy")
        val_s = f"{100 * val:.2f} %" if isinstance(val, float) else "-"
        lines.append(f"| {name} | {100 * r['accuracy']:.2f} % | {val_s} | {times} |")
    return "\n".join(lines)


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_metrics(run_dir: Path, payload: dict[str, Any]) -> None:
    """``metrics.json`` with a top-level ``results`` object."""
    _write_text(run_dir / "metrics.json", json.dumps(payload, indent=2, default=float))


def mark_failed(run_dir: Path, error: str) -> None:
    """Set ``status: failed`` and ``error`` in ``metrics.json``, keeping what it already holds.

    Flower's ``flwr run`` exits 0 when a ServerApp fails: this is where a script
    can tell.
    """
    path = run_dir / "metrics.json"
    try:
        payload = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        payload = {}
    payload = payload if isinstance(payload, dict) else {}
    write_metrics(run_dir, {**payload, "status": "failed", "error": error})


def write_config(run_dir: Path, flat_config: dict[str, Any]) -> None:
    """The resolved run config as ``config.yaml``."""
    _write_text(run_dir / "config.yaml", yaml.safe_dump(flat_config, sort_keys=True))


def write_report(run_dir: Path, title: str, results: dict[str, dict[str, Any]],
                 notes: list[str]) -> None:
    """``report.md``: the table plus short notes on the run."""
    body = [f"# {title}", "", results_table(results), ""]
    body += [f"- {n}" for n in notes]
    _write_text(run_dir / "report.md", "\n".join(body) + "\n")


def append_report(run_dir: Path, lines: list[str]) -> None:
    """Add ``lines`` to the end of ``report.md`` (rewritten atomically)."""
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    _write_text(run_dir / "report.md", report + "\n" + "\n".join(lines) + "\n")


def _to_rgb(images: torch.Tensor) -> np.ndarray:
    x = images.float()
    lo = x.amin(dim=(1, 2, 3), keepdim=True)
    hi = x.amax(dim=(1, 2, 3), keepdim=True)
    x = ((x - lo) / (hi - lo).clamp_min(1e-6)).permute(0, 2, 3, 1).numpy()
    return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def class_examples(pool: SyntheticPool, num_classes: int, per_class: int) -> list[list[int]]:
    """Indices of the first ``per_class`` images of each class (fewer where a class has fewer)."""
    return [torch.nonzero(pool.labels == c).flatten()[:per_class].tolist()
            for c in range(num_classes)]


def _marked_image(pool: SyntheticPool, rgb: np.ndarray, index: int, patch_size: int,
                  marks: bool) -> np.ndarray:
    """One image as RGB; with ``marks``, L patches shaded red and pruned ones blue."""
    img = rgb[index].copy()
    if not marks:
        return img
    grid = pool.images.shape[-1] // patch_size
    kept = pool.kept_mask[index].view(grid, grid).numpy()
    high = pool.high_mask[index].view(grid, grid).numpy()
    block = np.ones((patch_size, patch_size))
    for mask, colour in ((kept & ~high, (1.0, 0.0, 0.0)), (~kept, (0.0, 0.2, 1.0))):
        pix = np.kron(mask, block).astype(bool)
        img[pix] = 0.55 * img[pix] + 0.45 * np.array(colour)
    return img


def plot_pool_grids(pools: dict[str, SyntheticPool], path: Path, patch_size: int,
                    num_classes: int, per_class: int = 4, marks: bool = True,
                    title: str = "") -> None:
    """Synthetic images per class (rows), one block of ``per_class`` columns per pool.

    Parameters
    ----------
    pools
        Pools by the label printed above their block, e.g. ``{"no prior": ...,
        "prior": ...}``: the same classes side by side.
    marks
        Shade low-attention (L) patches red and pruned ones blue.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = min(num_classes, 20)
    cols = per_class * len(pools)
    fig, axes = plt.subplots(classes, cols, figsize=(1.2 * cols, 1.2 * classes + 0.3),
                             squeeze=False)
    for block, (label, pool) in enumerate(pools.items()):
        rgb = _to_rgb(pool.images)
        for row, idx in enumerate(class_examples(pool, classes, per_class)):
            for col in range(per_class):
                ax = axes[row][block * per_class + col]
                ax.set_xticks([])
                ax.set_yticks([])
                if row == 0 and col == 0:
                    ax.set_title(label, fontsize=8, loc="left")
                if block == 0 and col == 0:
                    ax.set_ylabel(str(row), rotation=0, labelpad=10)
                if col >= len(idx):
                    ax.axis("off")
                    continue
                ax.imshow(_marked_image(pool, rgb, idx[col], patch_size, marks),
                          interpolation="nearest")
    fig.suptitle(title or "synthetic images per class (red: low-attention L, blue: pruned)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_synthetic_grid(pool: SyntheticPool, path: Path, patch_size: int, num_classes: int,
                        per_class: int = 4, title: str = "") -> None:
    """Synthetic images per class (rows): L patches shaded red, pruned ones blue."""
    plot_pool_grids({"": pool}, path, patch_size, num_classes, per_class, title=title)


def plot_closest_pairs(pairs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                       path: Path) -> None:
    """Each pool's synthetic images nearest a training image (top row) above those images.

    ``pairs`` maps a pool's name to its synthetic images, their nearest training
    images and the pixel distances (``fedmitr_core.privacy.audit.closest_pairs``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(d) for _, _, d in pairs.values())
    fig, axes = plt.subplots(2 * len(pairs), cols, figsize=(1.2 * cols, 2.6 * len(pairs)),
                             squeeze=False)
    for block, (name, (synthetic, real, dist)) in enumerate(pairs.items()):
        for row, images in enumerate((_to_rgb(synthetic), _to_rgb(real))):
            for col in range(cols):
                ax = axes[2 * block + row][col]
                ax.set_xticks([])
                ax.set_yticks([])
                if col >= len(images):
                    ax.axis("off")
                    continue
                ax.imshow(images[col], interpolation="nearest")
                if row == 0:
                    ax.set_title(f"{float(dist[col]):.1f}", fontsize=7)
            axes[2 * block + row][0].set_ylabel(
                f"{name}\nsynthetic" if row == 0 else "nearest\ntraining", fontsize=6)
    fig.suptitle("synthetic images nearest a client's training image (pixel L2 above each)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_label_distribution(label_counts: np.ndarray, client_ids: list[str], path: Path
                            ) -> None:
    """Stacked bars: examples of each class held by each client."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k, c = label_counts.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * k + 2), 3.2))
    bottom = np.zeros(k)
    cmap = plt.get_cmap("tab20" if c > 10 else "tab10")
    for cls in range(c):
        ax.bar(range(k), label_counts[:, cls], bottom=bottom, color=cmap(cls % cmap.N),
               label=str(cls), width=0.8)
        bottom += label_counts[:, cls]
    ax.set_xlabel("client")
    ax.set_ylabel("examples")
    ax.set_xticks(range(k))
    ax.set_xticklabels([str(i) for i in range(k)], fontsize=6)
    if c <= 20:
        ax.legend(title="class", fontsize=6, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.set_title("label distribution of the accepted uploads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_rounds(ax: Any, rounds: list[dict[str, float]], levels: dict[str, float]) -> None:
    """On ``ax``: FedAvg test accuracy per round, each one-shot level as a line."""
    ax.plot([r["round"] for r in rounds], [100 * r["accuracy"] for r in rounds], "o-",
            color="C0", label="fedavg-rounds")
    for i, (name, acc) in enumerate(levels.items()):
        ax.axhline(100 * acc, linestyle=":" if name == "ensemble" else "--", color=f"C{i + 1}",
                   label=f"{name} (one shot)")
    ax.set_xlabel("communication rounds")
    ax.set_ylabel("test top-1 (%)")
    ax.legend(fontsize=7)


def plot_rounds(rounds: list[dict[str, float]], levels: dict[str, float], path: Path) -> None:
    """Test accuracy of multi-round FedAvg per round, one-shot methods as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    draw_rounds(ax, rounds, levels)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
