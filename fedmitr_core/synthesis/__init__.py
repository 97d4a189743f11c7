"""Synthetic data: the pool, model inversion and generator-based synthesis."""
