"""The destination's word: how a return replaces what is at ``output.url``
without a consumer ever reading a manifest that does not describe the
files beside it.

Layout of a destination::

    <output.url>/manifest.json    the newest COMPLETED run: describes exactly the files beside it
    <output.url>/<files>          that run's output files
    <output.url>/partial/         the newest run that did not complete (partial or failed):
    <output.url>/partial/manifest.json   its own manifest, describing exactly the files in partial/
    <output.url>/checkpoints/     durable checkpoints (by default; named by each manifest's ``checkpoint``)

A run that does not complete never writes at the top: an earlier complete
output stays whole, and nothing there looks finished that is not.

Every return into a folder (the top, or ``partial/``) follows one protocol
(:class:`Destination`):

1. **withdraw** -- the folder's ``manifest.json`` is replaced, in one atomic
   write, by a manifest with ``status: returning`` naming this run, the files
   it is about to write and the files E31 wrote there before; from here on a
   consumer sees "a return is in progress", never an old verdict over
   changing files;
2. temporary objects a killed return left (``*.e31-part-<hex>``) are removed (a return into
   ``partial/`` removes those at the top too: :meth:`Destination.remove_strays`);
3. the files are published, each whole (:func:`e31.tasks.storage.publish_file`);
4. files E31 wrote there before that this run did not write are removed;
   other files found there are listed in the manifest as ``stale``;
5. the new manifest is written, last.

A return killed at any step leaves either the old manifest (before step 1)
or the ``returning`` one; the next return (``e31 return JOB``, or the next
run) starts again at step 1 and knows from it which files were E31's.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any, Iterable

from e31.tasks import storage
from e31.tasks.manifest_model import STATUSES, Manifest, ReturningNote, parse_manifest

MANIFEST = "manifest.json"
PARTIAL = "partial"
CHECKPOINTS = "checkpoints"
#: Statuses of a manifest whose files a consumer may use (``returning`` is not one).
FINAL_STATUSES = STATUSES
#: E31's own transient names: a write's temporary (``NAME.e31-part-<hex>`` or ``.e31-part-<hex>``)
#: and a destination probe (``.e31-probe-<hex>``).  Never part of an output; a consumer ignores them.
_TEMPORARY = re.compile(r"(^|/)(.*\.e31-part-[0-9a-f]{8}|\.e31-probe-[0-9a-f]{8})$")


def read_manifest(url: str) -> dict[str, Any] | None:
    """The manifest at ``url`` (a folder) as its decoded JSON object, or None
    when absent or unreadable (not JSON, truncated, not an object)."""
    try:
        data = json.loads(storage.read_bytes(storage.join(url, MANIFEST)))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_manifest(url: str) -> Manifest | ReturningNote | None:
    """The manifest at ``url`` (a folder), typed (:func:`e31.tasks.manifest_model.parse_manifest`);
    None when absent, unreadable, or not a manifest of either shape (hand-edited)."""
    return parse_manifest(read_manifest(url))


def known_files(manifest: Manifest | ReturningNote | None) -> set[str]:
    """Relative paths E31 wrote into a folder according to its manifest: the
    files of a final manifest, or both lists of a ``returning`` one."""
    if manifest is None:
        return set()
    if isinstance(manifest, ReturningNote):
        names = set(manifest.writing) | set(manifest.written_before)
    else:
        names = {f.path for f in manifest.files}
    return {n for n in names if n}


class Destination:
    """One folder a return writes into: ``url`` (the output URL, or its
    ``partial/``), with ``skip`` the top-level sub-folders that are not part
    of its files (``checkpoints``, ``partial``)."""

    def __init__(self, url: str, skip: Iterable[str] = ()):
        self.url = url.rstrip("/")
        self.skip = tuple(skip)
        self.before: set[str] = set()

    def withdraw(self, job: str, run_id: str | None, writing: list[str]) -> None:
        """Step 1: replace the folder's manifest by a ``returning`` one (a
        single atomic write), remembering which files E31 had written there."""
        self.before = known_files(load_manifest(self.url))
        note = ReturningNote(
            job=job,
            run_id=run_id,
            status="returning",
            message="a return is in progress: the files here may be from two runs; use them once this manifest "
                    "says completed",
            writing=sorted(writing),
            written_before=sorted(self.before),
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        storage.write_bytes(storage.join(self.url, MANIFEST), json.dumps(note.to_json_dict(), indent=2).encode())

    def listing(self, transient: bool = False) -> list[str]:
        """Relative paths of every file now in the folder (sub-folders in
        :attr:`skip`, the manifest and -- unless ``transient`` -- E31's
        transient names left out); [] when it does not exist."""
        fs, root = storage.filesystem(self.url)
        root = root.rstrip("/")
        try:
            found = fs.find(root, withdirs=False)
        except FileNotFoundError:
            return []
        rels = []
        for path in found:
            rel = path[len(root):].lstrip("/") if path.startswith(root) else path
            if not rel or rel == MANIFEST or rel.endswith("/") or rel.split("/", 1)[0] in self.skip:
                continue
            if not transient and _TEMPORARY.search(rel):
                continue
            rels.append(rel)
        return sorted(rels)

    def remove_temporaries(self, writing: list[str] = (), own_folder: bool = False) -> list[str]:
        """Step 2: remove E31's transient objects a killed return or probe
        left (``*.e31-part-<hex>``, ``.e31-probe-<hex>``), and the files E31
        wrote here before that this run does not write (the manifest already
        says a return is in progress): none of them can then stand in the
        way of a new file (a file ``foo`` where ``foo/bar`` goes).  Returns
        the removed relative paths."""
        new = set(writing)
        gone = [rel for rel in self.listing(transient=True)
                if _TEMPORARY.search(rel) or ((own_folder or rel in self.before) and rel not in new)]
        for rel in gone:
            storage.remove_file(storage.join(self.url, rel))
        return gone

    def remove_strays(self) -> list[str]:
        """Remove only E31's transient objects a killed return left here
        (``*.e31-part-<hex>``, ``.e31-probe-<hex>``; the sub-folders in
        :attr:`skip` left out), nothing else: what a return into
        ``partial/`` does for the top, whose own next step 2 comes only with
        the next complete run.  Returns the removed relative paths."""
        gone = [rel for rel in self.listing(transient=True) if _TEMPORARY.search(rel)]
        for rel in gone:
            storage.remove_file(storage.join(self.url, rel))
        return gone

    def settle(self, written: set[str], own_folder: bool) -> list[str]:
        """Step 4: remove what E31 wrote here before and this run did not
        (with ``own_folder``, every file that is not this run's: ``partial/``
        holds only E31's files); returns the other files found (``stale``)."""
        stale = []
        for rel in self.listing():
            if rel in written:
                continue
            if own_folder or rel in self.before:
                storage.remove_file(storage.join(self.url, rel))
            else:
                stale.append(rel)
        return stale

    def publish_manifest(self, manifest: dict[str, Any]) -> None:
        """Step 5: write the final manifest (one atomic write)."""
        storage.write_bytes(storage.join(self.url, MANIFEST), json.dumps(manifest, indent=2).encode())

    def clear(self) -> None:
        """Remove the folder's manifest, then its files (a superseded
        ``partial/`` once a run completed)."""
        if read_manifest(self.url) is None and not self.listing():
            return
        storage.remove(storage.join(self.url, MANIFEST))
        storage.remove(self.url)
