"""fl_split: vertical split learning with privacy protection, on Flower, PyTorch and Ray.

Citations in docstrings resolve in ``docs/references.md``: papers by id (000–003: e.g. "001 §3.4,
Eq. 10"), the specification's sections ("spec §3") and the design and privacy principles
("design principle 1", "privacy principle 4").
"""

__version__ = "0.1.0"
