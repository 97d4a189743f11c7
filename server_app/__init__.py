"""FedMITR ServerApp: one round, validate and persist uploads, distil the global ViT."""
