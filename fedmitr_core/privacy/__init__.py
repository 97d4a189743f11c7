"""Differential privacy for clients (DP-SGD, Gaussian releases) and the privacy audit."""
