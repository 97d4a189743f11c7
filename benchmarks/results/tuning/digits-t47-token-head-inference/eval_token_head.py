"""t47 (offline): LV-ViT's inference rule on FedMITR students already trained.

TokenLabeling's LV-ViT predicts with ``cls_logits + w * max over tokens of the
token head's logits`` (w = 0.5); FedMITR's student predicts with its CLS head
only. This reads the final student checkpoint (``state/fedmitr/distill.pt``, CLS
and token head) of each run folder given, and prints its validation and test
top-1 for w in {0, 0.25, 0.5, 1} with max- and mean-pooled token logits, one JSON
line per run. Nothing is trained.

    python benchmarks/results/tuning/digits-t47-token-head-inference/eval_token_head.py \
        RUN_FOLDER [RUN_FOLDER ...] > results.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml

from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.models.student import StudentViT
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.server.state import load_checkpoint


@torch.no_grad()
def scores(student: StudentViT, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1 (%) of every inference rule tried."""
    cls_logits, token_logits = student.forward_tokens(images)
    pooled = {"max": token_logits.max(1)[0], "mean": token_logits.mean(1)}
    out = {}
    for agg, tok in pooled.items():
        for w in (0.0, 0.25, 0.5, 1.0):
            out[f"{agg} {w}"] = (cls_logits + w * tok).argmax(1)
        out[f"{agg} tokens only"] = tok.argmax(1)
    return {k: round(100 * float((p == labels).float().mean()), 1) for k, p in out.items()}


def main(folders: list[str]) -> None:
    """Print one JSON line of scores per run folder."""
    torch.set_num_threads(1)
    for folder in map(Path, folders):
        cfg = parse_config(yaml.safe_load((folder / "config.yaml").read_text()))
        data = load_dataset(cfg.data, cfg.seed)
        saved = load_checkpoint(folder / "state" / "fedmitr" / "distill.pt")
        if saved is None:
            sys.exit(f"{folder}: no state/fedmitr/distill.pt")
        student = StudentViT(vit_factory(cfg.model, data.spec)())
        student.load_state_dict(saved["student"])
        student.eval()
        row = {"run": folder.name, "student steps": int(saved["steps"])}
        for name, split in (("val", data.val), ("test", data.test)):
            row |= {f"{name} {k}": v for k, v in scores(student, split.images,
                                                          split.labels).items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
