"""FedMITR core: everything that is not Flower (config, data, models, methods, reports)."""

__version__ = "0.1.0"
