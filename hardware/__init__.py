"""Hardware strategies: placement, precision and collectives as values a step receives."""

from .precision import PRECISIONS, MixedPrecision, TruePrecision, precision
from .single import SingleDevice, single_device

__all__ = [
    "PRECISIONS",
    "MixedPrecision",
    "SingleDevice",
    "TruePrecision",
    "precision",
    "single_device",
]
