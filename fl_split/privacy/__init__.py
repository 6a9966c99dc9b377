"""Boundary mechanisms, denoising, budget allocation, ledgers and accountants (spec §3, §5).

The package imports nothing heavy by itself: ``fl_split.privacy.accountants`` (read by the
configuration, hence by ``fl-split --help``) must not pull in torch.
"""

__all__ = ["Mechanism", "NoDefense", "PostProcess", "Release"]


def __getattr__(name):
    if name in __all__:
        from fl_split.privacy import base

        return getattr(base, name)
    raise AttributeError(f"module 'fl_split.privacy' has no attribute {name!r}")
