"""Datasets, splits, client partitions and a deployed client's own files."""
