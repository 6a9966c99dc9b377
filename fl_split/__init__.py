"""fl_split: vertical split learning with privacy protection, on Flower, PyTorch and Ray."""

__version__ = "0.1.0"
