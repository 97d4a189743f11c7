"""What a client does: load its data, train the local ViT, describe its upload."""
