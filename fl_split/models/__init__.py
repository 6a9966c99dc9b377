"""Named split architectures, cut-layer position, and the builder."""

from fl_split.models.registry import (
    Architecture,
    SplitModules,
    build_bottom,
    build_modules,
    build_top,
    get_architecture,
    model_names,
)

__all__ = ["Architecture", "SplitModules", "build_bottom", "build_modules", "build_top",
           "get_architecture", "model_names"]
