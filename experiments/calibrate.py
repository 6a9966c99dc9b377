"""Moved to :mod:`fl_split.bench.calibrate` (issue 28: ``fl-split bench`` calibrates with it); kept
importable here for ``experiments/matched.py`` and the scripts that import ``calibrate``."""

from fl_split.bench.calibrate import *  # noqa: F401,F403
from fl_split.bench.calibrate import __all__  # noqa: F401
