"""The files of a user folder that a run may share or load: never anything outside the folder.

A model dir or an `hf:` dataset folder is read to be shared on the bus (`areal.launch.join`:
every role's account can read the run's files store) or copied into a run's output. A symbolic
link in it could name any file this host's user can read: the run's signing key, a role's NATS
credentials. `contained_files` walks the folder itself instead of following links blindly.

Invariants:
- every path returned is a regular file whose real path (links resolved) lies under `within`
  (default: the folder's own real path); a link that resolves outside it, a dangling link, a
  link loop and a special file (FIFO, socket, device) raise `EscapingPath` naming the path and
  the fix, before anything is read or shared;
- links inside the folder are allowed: a Hugging Face hub snapshot's `snapshots/<sha>/x`
  links into its own `blobs/` pass with `within` = the repo folder; a directory link is walked
  once per real directory (no loops, no duplicates through two names);
- nothing whose real path lies in a `forbidden` folder (the run's keys, its NATS credentials)
  is ever returned, whatever `within` allows;
- paths are returned under the names they have in the folder (a link keeps its own name), sorted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["EscapingPath", "check_contained_file", "contained_files", "share_root"]


class EscapingPath(ValueError):
    """A path a run would share or load names something outside its folder, or not a file."""


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _real(path: Path, *, shown: Path) -> Path:
    if not path.is_symlink() and not path.exists():
        raise FileNotFoundError(f"{shown}: no such file or folder")
    try:
        return path.resolve(strict=True)
    except (FileNotFoundError, RuntimeError, OSError) as e:
        kind = "a link loop" if isinstance(e, RuntimeError) else "a dangling link"
        raise EscapingPath(
            f"{shown} is {kind}: remove it (a shared or loaded folder holds only its own files)"
        ) from None


def _check_real(
    real: Path, *, shown: Path, within: Path, forbidden: tuple[Path, ...], is_link: bool
) -> None:
    for secret in forbidden:
        if _inside(real, secret):
            raise EscapingPath(
                f"{shown} leads to the run's secret {real} (keys or NATS credentials): remove it; "
                "secrets never go into a shared or loaded folder"
            )
    if is_link and not _inside(real, within):
        raise EscapingPath(
            f"{shown} is a link to {real}, outside {within}: replace the link with a copy of "
            "the file, or remove it (links may only point inside the folder)"
        )


def share_root(folder: str | Path) -> Path:
    """Where links under `folder` may point: its real path, or for a Hugging Face hub cache
    snapshot (`<repo>/snapshots/<sha>`, beside `<repo>/blobs`) the repo folder, whose `blobs/`
    its links name."""
    real = Path(folder).expanduser().resolve()
    repo = real.parent.parent
    if real.parent.name == "snapshots" and (repo / "blobs").is_dir():
        return repo
    return real


def _resolved(paths: Iterable[str | Path | None]) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser().resolve() for p in paths if p is not None)


def check_contained_file(
    path: str | Path,
    *,
    within: str | Path | None = None,
    forbidden: Iterable[str | Path | None] = (),
) -> Path:
    """`path` itself, when it is (a link to) a regular file under `within` (default: anywhere,
    for a file the user named) and not in a `forbidden` folder; else `EscapingPath`."""
    p = Path(path).expanduser()
    real = _real(p, shown=p)
    root = real if within is None else Path(within).expanduser().resolve()
    _check_real(real, shown=p, within=root, forbidden=_resolved(forbidden), is_link=p.is_symlink())
    if not stat.S_ISREG(real.stat().st_mode):
        raise EscapingPath(f"{p} is not a regular file (a FIFO, socket or device): remove it")
    return p


def contained_files(
    folder: str | Path,
    *,
    within: str | Path | None = None,
    forbidden: Iterable[str | Path | None] = (),
) -> list[Path]:
    """The regular files under `folder`, recursively, checked as the module docstring says.

    `within`: where links may point (default: `share_root(folder)`); `forbidden`: folders whose
    files are never returned (None entries are ignored)."""
    top = Path(folder).expanduser()
    root = Path(within).expanduser().resolve() if within is not None else share_root(top)
    secrets = _resolved(forbidden)
    out: list[Path] = []
    seen: set[Path] = set()

    def walk(shown_dir: Path, real_dir: Path) -> None:
        if real_dir in seen:
            return
        seen.add(real_dir)
        with os.scandir(shown_dir) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                shown = shown_dir / entry.name
                is_link = entry.is_symlink()
                real = _real(shown, shown=shown) if is_link else real_dir / entry.name
                _check_real(real, shown=shown, within=root, forbidden=secrets, is_link=is_link)
                mode = real.stat().st_mode if is_link else entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    walk(shown, real)
                elif stat.S_ISREG(mode):
                    out.append(shown)
                else:
                    raise EscapingPath(
                        f"{shown} is not a regular file (a FIFO, socket or device): remove it "
                        "(a shared or loaded folder holds only files and folders)"
                    )

    real_top = _real(top, shown=top)
    _check_real(real_top, shown=top, within=real_top, forbidden=secrets, is_link=False)
    if not real_top.is_dir():
        raise EscapingPath(f"{top} is not a folder")
    walk(top, real_top)
    return sorted(out)
