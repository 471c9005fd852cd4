"""Local-disk helpers of the storage layer: hashing, walking an output
folder, fsync and removal."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

from e31.errors import E31Error


class VerifyError(E31Error, RuntimeError):
    """A copy does not match what it must hold (size, ETag or sha256): a staged
    input, a published output file or an uploaded checkpoint.  The message
    names the copy (URLs masked) and both values."""


CHUNK = 4 * 1024 * 1024  # bytes read per hashing step


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a local file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def walk_files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root`` in sorted order, skipping temporary
    ``.part-`` files left by interrupted writes."""
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and ".part-" not in path.name:
            yield path


def fsync_path(path: Path) -> None:
    """Flush a local file, or a folder's entries, to disk (``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    if path.is_file():
        fsync_path(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def regular_files(root: Path, skip: tuple[str, ...] = ()) -> tuple[list[tuple[Path, str]], list[str]]:
    """The files under the local folder ``root`` that may leave the job, and
    why the others may not.

    Returns ``([(path, relative POSIX name)], [refusal])`` in sorted order.
    A file may leave when it is a regular file with one name, or a symbolic
    link to such a file inside ``root``.  Refused, each with one line naming
    it: a link leading out of ``root`` (it would send a host file), a hard
    link (its content is another name's, possibly a host file's), a FIFO,
    socket or device.  Temporary ``.e31-part-`` names and top-level names in
    ``skip`` are left out.  A missing ``root`` has no files."""
    root = Path(root)
    real_root = root.resolve()
    files: list[tuple[Path, str]] = []
    refused: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for name in list(dirnames):
            sub = base / name
            if sub.is_symlink():  # os.walk does not enter it: judge it as a file
                dirnames.remove(name)
                filenames.append(name)
        dirnames.sort()
        for name in sorted(filenames):
            path = base / name
            rel = path.relative_to(root).as_posix()
            if rel.split("/", 1)[0] in skip:
                continue
            why = _why_not(path, real_root) if ".e31-part-" not in name and ".e31-probe-" not in name else \
                "a name of E31's own temporary files (.e31-part-, .e31-probe-); give the file another name"
            if why is None and any("\udc80" <= c <= "\udcff" for c in rel):
                why = "a name that is not UTF-8 text (object stores and manifests cannot hold it); rename the file"
            if why:
                shown = rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                refused.append(f"{shown}: {why}")
            else:
                files.append((path, rel))
    return sorted(files, key=lambda pair: pair[1]), refused


def _why_not(path: Path, real_root: Path) -> str | None:
    """Why the file at ``path`` may not leave the job, or None.  A symbolic
    link is judged by what it leads to (inside the folder, one regular file
    with one name): a link to a hard link would otherwise carry a host file."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = path.resolve(strict=True)
            st = os.stat(target)
        except RuntimeError:
            return "a symbolic link loop"
        except OSError:
            return "a symbolic link to nothing (broken)"
        if not target.is_relative_to(real_root):
            return f"a symbolic link to {target}, outside the folder; write the file itself, not a link"
        if not stat.S_ISREG(st.st_mode):
            return f"a symbolic link to {target}, which is not a regular file"
        if st.st_nlink > 1:
            return f"a symbolic link to a hard link ({st.st_nlink} names for one file); write a copy instead"
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        return f"{kind}, not a regular file"
    if st.st_nlink > 1:
        return (f"a hard link ({st.st_nlink} names for one file: its content may be a file outside the job's); "
                "write a copy instead")
    return None


#: Free bytes below which a disk counts as full when an error does not say so itself.
NEARLY_FULL_BYTES = 16 * 1024**2


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (or its nearest
    existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def space(path: Path) -> tuple[int, int]:
    """``(free bytes, total bytes)`` of the filesystem holding ``path``,
    as an unprivileged user may use them."""
    st = os.statvfs(mount_point(path))
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def human_size(n: float) -> str:
    """``n`` bytes as ``512 B``, ``3.2 MiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


SCRATCH_FIX = "free space there or point E31_SCRATCH at a larger disk"


def disk_full(path: Path, exc: BaseException | None = None, needed: int | None = None,
              fix: str = SCRATCH_FIX) -> str | None:
    """One line saying that the disk holding ``path`` is full -- when ``exc``
    is ``ENOSPC``/``EDQUOT`` (or says "No space left on device"), or the disk
    has less than :data:`NEARLY_FULL_BYTES` free -- with its mount point, what
    is free, when known ``needed`` bytes, and ``fix``; None when it is not full."""
    import errno

    said = exc is not None and (getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                                or "No space left on device" in str(exc))
    try:
        free, total = space(path)
    except OSError:
        return None
    if not said and free >= NEARLY_FULL_BYTES:
        return None
    need = f"; {human_size(needed)} needed" if needed else ""
    return (f"disk full: {mount_point(path)} (holding {path}) has {human_size(free)} free of {human_size(total)}"
            f"{need}; {fix}")


def no_space(path: Path, said: bool) -> str | None:
    """Why a work that failed may have failed for disk space, judged from the disk holding ``path`` (its
    scratch) and ``said``, whether its error output says ``No space left on device``: :func:`disk_full` when
    that disk is nearly full, or was said to be and has less than a tenth of itself free; when it was said
    and this disk has room, the full disk was another (a folder elsewhere, or on a job of several nodes
    another rank's node); None when nothing points at disk space."""
    import errno

    try:
        free, total = space(path)
    except OSError:
        return None
    if free < NEARLY_FULL_BYTES or (said and free < total / 10):
        return disk_full(path, OSError(errno.ENOSPC, "No space left on device") if said else None)
    if said:
        return (f"the work's error output says No space left on device, and {mount_point(path)} (holding {path}) "
                f"has {human_size(free)} free: the full disk is another one it wrote to (on a job of several "
                "nodes, maybe another rank's node: see its lines in the flow run's log)")
    return None

