"""timm ViT presets, the token-gather forward, the FedMITR student and evaluation."""
