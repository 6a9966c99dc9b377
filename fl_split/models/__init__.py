"""Named split architectures, cut-layer position, and the builder.

Names are imported lazily: ``fl_split.models.catalog`` (read by ``fl-split --help``) must not pull
in PyTorch through this package.
"""

__all__ = ["Architecture", "SplitModules", "build_bottom", "build_modules", "build_top",
           "get_architecture", "model_names"]


def __getattr__(name):
    if name in __all__:
        from fl_split.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'fl_split.models' has no attribute {name!r}")
