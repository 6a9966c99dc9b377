"""Boundary mechanisms, denoising, budget allocation, ledgers and accountants (SPEC §3, §5)."""

from fl_split.privacy.base import Mechanism, NoDefense, PostProcess, Release

__all__ = ["Mechanism", "NoDefense", "PostProcess", "Release"]
