"""Owner-only files and directories for everything that holds a secret or a party's data.

A party's data file (the host's holds the labels), its private seed, its TLS and authentication
keys and its checkpoints (which hold its :class:`~fl_split.seeding.PartySecret`) are readable by
whoever can read the file: on a shared machine, by every local user unless the mode says
otherwise (DESIGN, "Privacy principles": a secret never leaves its party). So files are created
with mode 0600 *before* anything is written into them (no window in which a default umask of
022 exposes them), directories with 0700, and ``deploy local`` runs its processes under
:data:`PRIVATE_UMASK` (``docs/deploy.md``, "Who holds what").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: the umask of a deployment's processes: nothing they create is readable by group or others
PRIVATE_UMASK = 0o077


def private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and missing parents) and make it owner-only (0700)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def create_private(path: str | os.PathLike, exclusive: bool = False) -> Path:
    """Create ``path`` empty with mode 0600 (replacing a file there unless ``exclusive``), so that
    whatever writes into it afterwards (NumPy, pandas, pyarrow keep an existing file's mode)
    never leaves the content readable by others."""
    path = Path(path)
    if not exclusive:
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.fchmod(fd, 0o600)
    os.close(fd)
    return path


def write_private(path: str | os.PathLike, data: bytes, exclusive: bool = False) -> Path:
    """Write ``data`` to a file of mode 0600 (created with that mode; ``exclusive``: never replace
    an existing file). Not replaced atomically: for keys and seeds written once."""
    path = Path(path)
    if not exclusive:
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(data)
    return path


def _exposed(root: str | os.PathLike):
    """``(path, mode)`` of ``root`` and everything below it (symbolic links not followed) that the
    group or others may access."""
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
            yield path, stat.S_IMODE(st.st_mode)


def make_owner_only(root: str | os.PathLike) -> list[Path]:
    """Remove the group and other permission bits of ``root`` and everything below it (symbolic
    links are not followed); returns the paths that were changed."""
    changed = []
    for path, mode in list(_exposed(root)):
        os.chmod(path, mode & ~0o077)
        changed.append(path)
    return changed


def readable_by_others(root: str | os.PathLike) -> list[tuple[Path, int]]:
    """``(path, mode)`` of everything under ``root`` (itself included) the group or others may access."""
    return list(_exposed(root))
