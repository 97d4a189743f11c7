"""FedMITR ClientApp: train the local ViT on this node's data and upload once."""
