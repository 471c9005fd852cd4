"""Staging inputs from a real S3 server (SeaweedFS), a real HTTP server and
local disk: trees, globs, the staging cache, preflight errors, ETag
verification, sources replaced during a copy, and Prefect's retries of
transient errors.  No mocks: every byte goes through fsspec to a real store.

Objects are written by a separate S3 client (``s3_server.filesystem()``, no
instance cache), as a producer in another process would, never through the
s3fs instance staging itself uses.
"""

from __future__ import annotations

import contextlib

import collections
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from e31.specs import DataInput
from e31.tasks import storage
from e31.tasks.storage.listing import list_input
from e31.tasks.stage import ATTEMPTS, StageError, preflight, stage_input, stage_task

MIB = 2**20


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _tree(root: Path) -> dict[str, str]:
    """{relative POSIX path: sha256} of every regular file under ``root``."""
    return {p.relative_to(root).as_posix(): _sha(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(data_dir: Path) -> list[str]:
    return sorted(p.name for p in data_dir.iterdir() if ".part-" in p.name) if data_dir.exists() else []


def _record(data_dir: Path, name: str) -> dict:
    return json.loads((data_dir / f"{name}.stage.json").read_text())


@pytest.fixture
def writer(s3_server):
    """A separate S3 client (another producer), not the one staging uses."""
    return s3_server.filesystem()


# --------------------------------------------------------------------------- 1. from S3


def test_s3_single_object_cached_then_recopied_when_changed(s3_prefix, writer, tmp_path):
    url = s3_prefix + "in/table.csv"
    writer.pipe(url, b"a,b\n1,2\n")
    data = tmp_path / "data"
    item = DataInput(name="table", url=url)

    first = stage_input(item, data)
    assert (first.name, first.path, first.bytes, first.files, first.copied) == (
        "table", str(data / "table" / "table.csv"), 8, 1, True)
    assert _tree(data / "table") == {"table.csv": _sha(b"a,b\n1,2\n")}
    assert sorted(p.name for p in data.iterdir()) == ["table", "table.stage.json"]

    second = stage_input(item, data)
    assert (second.path, second.bytes, second.files, second.copied) == (first.path, 8, 1, False)

    writer.pipe(url, b"a,b\n9,9\n3,4\n")  # new content, new size, new ETag
    third = stage_input(item, data)
    assert (third.path, third.bytes, third.files, third.copied) == (first.path, 12, 1, True)
    assert _tree(data / "table") == {"table.csv": _sha(b"a,b\n9,9\n3,4\n")}
    assert _leftovers(data) == []


def test_s3_folder_with_and_without_slash_same_tree_never_nested(s3_prefix, writer, tmp_path):
    files = {"frames/a.bin": os.urandom(3000), "frames/sub/b.bin": os.urandom(17), "frames/sub/deep/c.txt": b"c"}
    writer.pipe({s3_prefix + k: v for k, v in files.items()})
    want = {k.removeprefix("frames/"): _sha(v) for k, v in files.items()}
    data = tmp_path / "data"
    root = data / "frames"
    for url in (s3_prefix + "frames", s3_prefix + "frames/", s3_prefix + "frames"):
        staged = stage_input(DataInput(name="frames", url=url), data)
        assert (staged.path, staged.bytes, staged.files) == (str(root), 3018, 3)
        assert _tree(root) == want  # never frames/frames/...
    # the URL string is the cache key: the same URL again is reused
    again = stage_input(DataInput(name="frames", url=s3_prefix + "frames"), data)
    assert again.copied is False

    writer.pipe(s3_prefix + "frames/sub/b.bin", b"B" * 17)  # same size, new content
    changed = stage_input(DataInput(name="frames", url=s3_prefix + "frames"), data)
    assert (changed.copied, changed.bytes, changed.files) == (True, 3018, 3)
    assert _tree(root) == {**want, "sub/b.bin": _sha(b"B" * 17)}
    assert _leftovers(data) == []


def test_s3_globs_stage_matches_relative_to_the_wildcard_base(s3_prefix, writer, tmp_path):
    files = {"imgs/x.png": b"x" * 10, "imgs/y.png": b"yy" * 7, "imgs/q.jpg": b"q", "imgs/n/z.png": b"zzz",
             "imgs/n/m/w.png": b"w" * 5, "other/o.png": b"o"}
    writer.pipe({s3_prefix + k: v for k, v in files.items()})
    data = tmp_path / "data"
    cases = [  # name, pattern, the wildcard's base, the staged relative paths
        ("flat", "imgs/*.png", "imgs/", ["x.png", "y.png"]),
        ("all", "imgs/**", "imgs/", ["n/m/w.png", "n/z.png", "q.jpg", "x.png", "y.png"]),
        ("deep", "imgs/**/*.png", "imgs/", ["n/m/w.png", "n/z.png", "x.png", "y.png"]),
        ("one", "imgs/n/?.png", "imgs/n/", ["z.png"]),
    ]
    for name, pattern, base, rels in cases:
        item = DataInput(name=name, url=s3_prefix + pattern)
        staged = stage_input(item, data)
        total = sum(len(files[base + r]) for r in rels)
        assert (staged.path, staged.bytes, staged.files, staged.copied) == (str(data / name), total, len(rels), True)
        assert _tree(data / name) == {r: _sha(files[base + r]) for r in rels}, pattern
        assert stage_input(item, data).copied is False
    assert _leftovers(data) == []


def test_s3_glob_changed_by_another_writer_is_copied_again(s3_prefix, writer, tmp_path):
    writer.pipe({s3_prefix + "imgs/x.png": b"old-x", s3_prefix + "imgs/y.png": b"y"})
    data = tmp_path / "data"
    item = DataInput(name="imgs", url=s3_prefix + "imgs/*.png")
    assert stage_input(item, data).copied is True
    writer.pipe(s3_prefix + "imgs/x.png", b"new content of x")
    again = stage_input(item, data)
    assert _tree(data / "imgs") == {"x.png": _sha(b"new content of x"), "y.png": _sha(b"y")}
    assert (again.copied, again.bytes) == (True, 17)


def test_s3_file_under_a_listed_folder_changed_by_another_writer_is_copied_again(s3_prefix, writer, tmp_path):
    writer.pipe({s3_prefix + "d/a.txt": b"A", s3_prefix + "d/b.txt": b"B"})
    data = tmp_path / "data"
    stage_input(DataInput(name="all", url=s3_prefix + "d/*.txt"), data)  # another input lists the prefix
    one = DataInput(name="a", url=s3_prefix + "d/a.txt")
    assert stage_input(one, data).copied is True
    writer.pipe(s3_prefix + "d/a.txt", b"A, version 2")
    again = stage_input(one, data)
    assert (again.copied, (data / "a" / "a.txt").read_bytes()) == (True, b"A, version 2")


def test_s3_glob_changed_after_preflight_is_staged_with_the_new_bytes(s3_prefix, writer, tmp_path):
    writer.pipe({s3_prefix + "imgs/x.png": b"xxxx", s3_prefix + "imgs/y.png": b"y"})
    item = DataInput(name="imgs", url=s3_prefix + "imgs/*.png")
    listing = preflight([item])["imgs"]
    writer.pipe(s3_prefix + "imgs/x.png", b"XXXX")  # same size, new bytes, after preflight
    staged = stage_input(item, tmp_path / "data", listing)
    assert (staged.copied, staged.bytes) == (True, 5)
    assert _tree(tmp_path / "data" / "imgs") == {"x.png": _sha(b"XXXX"), "y.png": _sha(b"y")}


# --------------------------------------------------------------------------- 2. preflight


def test_preflight_names_the_missing_input_and_copies_nothing(s3_prefix, writer, tmp_path):
    writer.pipe(s3_prefix + "good.bin", b"good")
    data = tmp_path / "data"
    data.mkdir()
    good = DataInput(name="good", url=s3_prefix + "good.bin")
    missing = DataInput(name="gone", url=s3_prefix + "nope/missing.bin")
    with pytest.raises(StageError) as err:
        preflight([good, missing])
    assert str(err.value) == f"data 'gone': {s3_prefix}nope/missing.bin: not found"
    assert list(data.rglob("*")) == []

    listings = preflight([good])
    assert list(listings) == ["good"]
    assert [(e.rel, e.size, e.etag) for e in listings["good"].entries] == [("good.bin", 4, _md5(b"good"))]
    assert list(data.rglob("*")) == []


def test_preflight_glob_matching_nothing_is_not_found(s3_prefix, writer):
    writer.pipe(s3_prefix + "imgs/a.jpg", b"a")
    url = s3_prefix + "imgs/*.png"
    with pytest.raises(StageError) as err:
        preflight([DataInput(name="pngs", url=url)])
    assert str(err.value) == f"data 'pngs': {url}: not found"


def test_preflight_glob_matching_only_folders_says_so(s3_prefix, writer, tmp_path):
    writer.pipe({s3_prefix + "frames/a/1.jpg": b"1", s3_prefix + "frames/b/2.jpg": b"2"})
    (tmp_path / "local" / "x").mkdir(parents=True)
    (tmp_path / "local" / "x" / "f.txt").write_text("f")
    for url in (s3_prefix + "fr*", f"{tmp_path}/local/*"):
        with pytest.raises(StageError) as err:
            preflight([DataInput(name="frames", url=url)])
        assert str(err.value) == (f"data 'frames': {url}: the pattern matches 1 folder(s) and no file; stage a folder "
                                  "with its URL (no wildcard), or match files inside (e.g. .../*/**)")


def test_sha256_declared_for_a_folder_or_glob_is_refused(s3_prefix, writer, tmp_path):
    writer.pipe({s3_prefix + "d/a": b"a", s3_prefix + "d/s/b": b"b"})
    for url, kind in ((s3_prefix + "d/", "folder"), (s3_prefix + "d/**", "glob")):
        with pytest.raises(StageError) as err:
            preflight([DataInput(name="d", url=url, sha256=_sha(b"a"))])
        assert str(err.value) == (f"data 'd': {url}: sha256 is declared but the URL is a {kind} of 2 file(s); "
                                  "declare sha256 for single files")
        with pytest.raises(StageError):
            stage_input(DataInput(name="d", url=url, sha256=_sha(b"a")), tmp_path / "data")
    assert not (tmp_path / "data").exists()


# --------------------------------------------------------------------------- 3. ETag verification


@pytest.mark.parametrize("size", [4096, 20 * MIB])
def test_copy_refused_by_etag_is_listed_and_copied_again(s3_prefix, writer, tmp_path, prefect_api, size,
                                                         monkeypatch):
    """A listing whose ETag (a well-formed MD5) is not the object's: the copy
    is refused by the ETag check; staging lists again (getting the store's
    real ETag) and the second copy is accepted.  The 20 MiB object is
    fetched in one stream and checked while it downloads (etag.Follower)."""
    from prefect import flow

    from e31.tasks.storage import etag, transfer

    monkeypatch.setattr(transfer, "STREAMS_PER_FILE", 1)
    # a store that ignores If-Match (E31 pins reads to the listed ETag): the content check must catch it
    monkeypatch.setattr(transfer.s3session, "pinned", lambda objects: contextlib.nullcontext())
    followed = []
    result = etag.Follower.result
    monkeypatch.setattr(etag.Follower, "result", lambda self: followed.append(result(self)) or followed[-1])
    body = os.urandom(size)
    url = s3_prefix + "blob.bin"
    writer.pipe(url, body)
    item = DataInput(name="blob", url=url)
    real = list_input(url)
    wrong = _md5(b"not the content")
    bad = dataclasses.replace(real, entries=[e._replace(etag=wrong, version=wrong) for e in real.entries])

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        @flow
        def run():
            return stage_task(item, str(tmp_path / "data"), bad)

        staged = run()
    finally:
        logger.removeHandler(handler)
    assert lines == [f"stage blob: blob.bin: content differs from the store's ETag {wrong}; "
                     f"listing and copying again (attempt 2 of {ATTEMPTS})"]
    assert (staged.copied, staged.bytes, staged.files) == (True, size, 1)
    assert _tree(tmp_path / "data" / "blob") == {"blob.bin": _sha(body)}
    assert followed == ([False, True] if size >= transfer.FOLLOW_BYTES else [])
    assert _record(tmp_path / "data", "blob")["digest"] == real.digest() != bad.digest()
    assert _leftovers(tmp_path / "data") == []


class _Store:
    """What the HTTP test server serves: path -> (body, ETag header or None);
    ``fail_gets[path]``: how many GETs of it still answer 503; ``seen``
    counts requests per (method, path)."""

    def __init__(self):
        self.files: dict[str, tuple[bytes, str | None]] = {}
        self.fail_gets: dict[str, int] = {}
        self.statuses: dict[str, int] = {}  # path -> the status every request of it gets
        self.get_statuses: dict[str, int] = {}  # path -> the status its GETs get (HEADs answer normally)
        self.seen: collections.Counter = collections.Counter()
        self.lock = threading.Lock()


@pytest.fixture
def http_store():
    store = _Store()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, head: bool):
            with store.lock:
                store.seen[(self.command, self.path)] += 1
                found = store.files.get(self.path)
                status = store.statuses.get(self.path) or (None if head else store.get_statuses.get(self.path))
            if status is not None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with store.lock:
                fail = not head and found is not None and store.fail_gets.get(self.path, 0) > 0
                if fail:
                    store.fail_gets[self.path] -= 1
            if found is None or fail:
                self.send_response(404 if found is None else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body, etag = found
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            if etag:
                self.send_header("ETag", f'"{etag}"')
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_GET(self):
            self._answer(head=False)

        def do_HEAD(self):
            self._answer(head=True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    store.base = f"http://127.0.0.1:{server.server_address[1]}"
    yield store
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_store_whose_etag_never_matches_fails_and_keeps_the_previous_copy(http_store, tmp_path):
    """A store serving bytes that differ from the MD5 in its ETag on every
    listing: refused after ATTEMPTS copies; the good copy staged before, and
    its cache record, are left as they were."""
    v1, v2 = b"version one, 32 bytes long......", b"version TWO, 32 bytes long......"
    url = http_store.base + "/blob.bin"
    data = tmp_path / "data"
    item = DataInput(name="blob", url=url)
    http_store.files["/blob.bin"] = (v1, _md5(v1))
    assert stage_input(item, data).copied is True
    record = (data / "blob.stage.json").read_bytes()
    mtime = (data / "blob" / "blob.bin").stat().st_mtime_ns

    wrong = _md5(b"something else")
    http_store.files["/blob.bin"] = (v2, wrong)
    before = http_store.seen[("GET", "/blob.bin")]
    with pytest.raises(StageError) as err:
        stage_input(item, data)
    assert str(err.value) == (f"data 'blob': {url}: blob.bin: content differs from the store's ETag {wrong} "
                              f"({ATTEMPTS} attempts); stage it again when the source is stable")
    assert http_store.seen[("GET", "/blob.bin")] - before == ATTEMPTS
    assert _leftovers(data) == []
    assert sorted(p.name for p in data.iterdir()) == ["blob", "blob.stage.json"]
    assert _tree(data / "blob") == {"blob.bin": _sha(v1)}
    assert (data / "blob" / "blob.bin").stat().st_mtime_ns == mtime
    assert (data / "blob.stage.json").read_bytes() == record

    http_store.files["/blob.bin"] = (v1, _md5(v1))  # the store is back: the kept copy is still valid
    assert stage_input(item, data).copied is False


# --------------------------------------------------------------------------- 4. replaced during the copy


@pytest.mark.parametrize("streams", [1, 10])
def test_object_replaced_while_being_copied_is_never_spliced(s3_prefix, writer, tmp_path, streams, monkeypatch):
    """A 64 MiB object (fetched in one stream, hashed as it lands, or by s3fs
    in 10 concurrent ranged GETs) is replaced by a same-size object while it
    is being copied.  The new bytes are put aside first and swapped in by a
    server-side copy, so the replacement lands within milliseconds of the
    copy starting (a 64 MiB upload would mostly land after the staging
    ended)."""
    from e31.tasks.storage import transfer

    monkeypatch.setattr(transfer, "STREAMS_PER_FILE", streams)
    size = 64 * MIB
    old, new = os.urandom(size), os.urandom(size)
    url = s3_prefix + "big.bin"
    writer.pipe({url: old, url + ".next": new})
    data = tmp_path / "data"
    item = DataInput(name="big", url=url)
    outcome: dict = {}

    def stage():
        try:
            outcome["staged"] = stage_input(item, data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    worker = threading.Thread(target=stage)
    worker.start()
    copies: list[str] = []  # every temporary copy folder seen, in order
    replaced = False
    deadline = time.monotonic() + 60
    while worker.is_alive() and time.monotonic() < deadline:
        for part in _leftovers(data):  # the copy folders, not the record's own temporary file (.big.stage.json.part-)
            if part.startswith(".big.part-") and part not in copies:
                copies.append(part)
        if copies and not replaced:
            writer.copy(url + ".next", url)  # same size, other bytes, while the first copy runs
            replaced = True
        time.sleep(0.002)
    worker.join(5)
    assert not worker.is_alive()
    assert replaced, "the copy never started (no .part- folder seen)"
    assert "error" not in outcome, repr(outcome.get("error"))
    staged = outcome["staged"]
    assert (staged.copied, staged.bytes, staged.path) == (True, size, str(data / "big" / "big.bin"))
    got = storage.sha256_file(Path(staged.path))
    assert got in {_sha(old), _sha(new)}  # one whole version, never a mix
    # `old` only when the replacement landed after the post-copy listing (one copy); otherwise the
    # first copy was refused (changed while copying, or its MD5 is not the listed ETag) and the
    # input was listed and copied again: two temporary folders.
    assert len(copies) == (1 if got == _sha(old) else 2), copies
    assert _leftovers(data) == []

    final = stage_input(item, data)  # the store now holds `new` only
    assert final.copied is (got != _sha(new))
    assert storage.sha256_file(Path(final.path)) == _sha(new)


def test_stale_listing_is_listed_and_copied_again(s3_prefix, writer, tmp_path):
    old, new = os.urandom(MIB), os.urandom(MIB)
    url = s3_prefix + "obj.bin"
    writer.pipe(url, old)
    stale = list_input(url)  # e.g. taken by preflight
    writer.pipe(url, new)  # replaced after the listing, before the copy
    data = tmp_path / "data"
    staged = stage_input(DataInput(name="obj", url=url), data, stale)
    assert (staged.copied, staged.bytes) == (True, MIB)
    assert _tree(data / "obj") == {"obj.bin": _sha(new)}
    fresh = list_input(url)
    assert [e.etag for e in fresh.entries] == [_md5(new)] != [e.etag for e in stale.entries]
    assert _record(data, "obj")["digest"] == fresh.digest()
    assert _leftovers(data) == []


# --------------------------------------------------------------------------- 5. local


@pytest.fixture(params=["find", "scandir"])
def scanner(request, monkeypatch):
    """Local folders are listed by GNU find, or by os.scandir where there is
    none: both must give the same listing."""
    from e31.tasks.storage import listing

    if request.param == "scandir":
        monkeypatch.setattr(listing, "_GNU_FIND", None)
    elif listing._GNU_FIND is None:
        pytest.skip("no GNU find on this machine")
    return request.param


def test_local_folder_keeps_empty_folders_and_stages_symlinks_as_files(tmp_path, scanner):
    outside = tmp_path / "elsewhere" / "target.bin"
    outside.parent.mkdir()
    outside.write_bytes(b"linked content")
    src = tmp_path / "src"
    (src / "empty" / "deeper").mkdir(parents=True)
    (src / "sub").mkdir()
    (src / "sub" / "f.txt").write_bytes(b"file")
    (src / "link.bin").symlink_to(outside)
    data = tmp_path / "data"
    for url in (str(src), f"file://{src}/"):
        staged = stage_input(DataInput(name="tree", url=url), data)
        root = data / "tree"
        assert (staged.path, staged.bytes, staged.files, staged.copied) == (str(root), 18, 2, True)
        assert _tree(root) == {"link.bin": _sha(b"linked content"), "sub/f.txt": _sha(b"file")}
        assert not (root / "link.bin").is_symlink()
        assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir()) == [
            "empty", "empty/deeper", "sub"]
    assert _leftovers(data) == []
    outside.write_bytes(b"changed")  # the staged copy is data, not a link back to the source
    assert (data / "tree" / "link.bin").read_bytes() == b"linked content"


def test_local_folder_with_only_empty_folders(tmp_path, scanner):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "c").mkdir()
    staged = stage_input(DataInput(name="shell", url=str(src)), tmp_path / "data")
    root = tmp_path / "data" / "shell"
    assert (staged.bytes, staged.files) == (0, 0)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == ["a", "a/b", "c"]


def test_local_names_with_spaces_newlines_and_non_utf8_bytes(tmp_path, scanner):
    src = tmp_path / "src"
    (src / "a dir").mkdir(parents=True)
    (src / "a dir" / "two words.txt").write_bytes(b"1")
    (src / "line\nbreak.txt").write_bytes(b"22")
    odd = os.fsdecode(b"caf\xe9.bin")  # not UTF-8
    (src / odd).write_bytes(b"333")
    listing = list_input(str(src))
    assert [(e.rel, e.size) for e in listing.entries] == sorted(
        [("a dir/two words.txt", 1), ("line\nbreak.txt", 2), (odd, 3)])
    stage_input(DataInput(name="odd", url=str(src)), tmp_path / "data")
    assert _tree(tmp_path / "data" / "odd") == {"a dir/two words.txt": _sha(b"1"), "line\nbreak.txt": _sha(b"22"),
                                               odd: _sha(b"333")}


def test_local_broken_symlink_fails_the_preflight_naming_it(tmp_path, scanner):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "ok.txt").write_bytes(b"ok")
    (src / "sub" / "gone.bin").symlink_to(tmp_path / "nowhere")
    with pytest.raises(StageError) as err:
        preflight([DataInput(name="tree", url=str(src))])
    assert str(err.value) == f"data 'tree': {src}: cannot read (OSError: sub/gone.bin: broken symbolic link)"


def _make_tree(root, *, files: int, folders: int, content):
    """``root/d<i % folders>/f<i>.bin`` holding ``content(i)`` for i < files; returns ``root``."""
    for i in range(files):
        (root / f"d{i % folders}").mkdir(parents=True, exist_ok=True)
        (root / f"d{i % folders}" / f"f{i}.bin").write_bytes(content(i))
    return root


def test_local_folder_cache_sees_changed_sources_and_changed_copies(tmp_path, scanner):
    """Unchanged: reused.  A source file rewritten with the same size: copied
    again.  The staged copy changed in place by a previous run's work:
    copied again (the cache checks the copy's size and mtime too)."""
    src = _make_tree(tmp_path / "src", files=30, folders=3, content=lambda i: b"%04d" % i)
    item, data = DataInput(name="t", url=str(src)), tmp_path / "data"
    assert stage_input(item, data).copied is True
    assert stage_input(item, data).copied is False
    target = src / "d1" / "f7.bin"
    target.write_bytes(b"XXXX")
    os.utime(target, ns=(1, 1))  # same size, another mtime
    again = stage_input(item, data)
    assert again.copied is True and (data / "t" / "d1" / "f7.bin").read_bytes() == b"XXXX"
    assert stage_input(item, data).copied is False
    copy = data / "t" / "d2" / "f5.bin"
    copy.write_bytes(b"work")
    os.utime(copy, ns=(2, 2))
    assert stage_input(item, data).copied is True
    assert copy.read_bytes() == b"0005"


def test_an_unchanged_local_folder_is_reused_from_two_scans_without_a_listing(tmp_path):
    """The second run's preflight compares only the sha256 of two GNU find
    scans (ctime, inode and name; source and staged copy, taken at once)
    with the stage record's: no listing is parsed.  A source file touched, a file added to the copy or
    a record from before these scans each fall back to the full listing."""
    from e31.tasks.stage import Reused, quick_reuse
    from e31.tasks.storage import listing as listing_module

    if listing_module._GNU_FIND is None:
        pytest.skip("no GNU find on this machine")
    src = _make_tree(tmp_path / "src", files=12, folders=3, content=lambda i: b"%03d" % i)
    item, data = DataInput(name="t", url=str(src)), tmp_path / "data"
    assert stage_input(item, data, preflight([item], data)["t"]).copied is True
    record = json.loads((data / "t.stage.json").read_text())
    assert (record["kind"], record["bytes"], record["files"]) == ("folder", 36, 12)
    reused = preflight([item], data)["t"]
    assert isinstance(reused, Reused) and reused.entries == []
    assert (reused.bytes, reused.files, reused.staged.path, reused.staged.copied) == (36, 12, str(data / "t"), False)
    assert stage_input(item, data, reused) == reused.staged
    os.utime(src / "d0" / "f0.bin", ns=(7, 7))  # same size, another mtime
    assert quick_reuse(item, data) is None and not isinstance(preflight([item], data)["t"], Reused)
    assert stage_input(item, data).copied is True and quick_reuse(item, data) is not None
    os.chmod(data / "t" / "d1", 0o755)
    (data / "t" / "d1" / "left.tmp").write_bytes(b"by the work")
    assert quick_reuse(item, data) is None
    assert stage_input(item, data).copied is True and not (data / "t" / "d1" / "left.tmp").exists()
    assert len(record["source_hash"]) == len(record["copy_hash"]) == 64
    (data / "t.stage.json").write_text(json.dumps({k: v for k, v in record.items() if k not in ("source_hash",
                                                                                                "kind")}))
    assert quick_reuse(item, data) is None  # a record written before the scans were kept: listed as before

    empty = tmp_path / "empty"  # an empty folder, then a file at its path: not reused
    empty.mkdir()
    hollow = DataInput(name="e", url=str(empty))
    assert stage_input(hollow, data, preflight([hollow], data)["e"]).copied is True
    assert isinstance(preflight([hollow], data)["e"], Reused)
    empty.rmdir()
    empty.write_bytes(b"now a file")
    assert quick_reuse(hollow, data) is None
    staged = stage_input(hollow, data, preflight([hollow], data)["e"])
    assert staged.copied is True and Path(staged.path).read_bytes() == b"now a file"


def test_a_local_file_rewritten_with_its_size_and_mtime_put_back_is_copied_again(tmp_path):
    """A single local file (and a glob's files) is not reused on size and
    mtime alone: its ctime and inode count too (a rewrite that put both
    back was taken as unchanged)."""
    src = tmp_path / "one.bin"
    src.write_bytes(b"0123456789")
    item, data = DataInput(name="one", url=str(src)), tmp_path / "data"
    assert stage_input(item, data, preflight([item], data)["one"]).copied is True
    assert stage_input(item, data, preflight([item], data)["one"]).copied is False
    before = os.stat(src)
    src.write_bytes(b"9876543210")
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = stage_input(item, data, preflight([item], data)["one"])
    assert again.copied is True and Path(again.path).read_bytes() == b"9876543210"


def test_file_url_single_file_and_glob(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "one.csv").write_bytes(b"1\n")
    (src / "two.csv").write_bytes(b"22\n")
    (src / "skip.txt").write_bytes(b"no")
    data = tmp_path / "data"
    item = DataInput(name="one", url=f"file://{src}/one.csv", sha256=_sha(b"1\n"))
    staged = stage_input(item, data)
    assert (staged.path, staged.bytes, staged.files, staged.copied) == (str(data / "one" / "one.csv"), 2, 1, True)
    assert _tree(data / "one") == {"one.csv": _sha(b"1\n")}
    assert stage_input(item, data).copied is False
    glob = stage_input(DataInput(name="csvs", url=f"file://{src}/*.csv"), data)
    assert (glob.bytes, glob.files) == (5, 2)
    assert _tree(data / "csvs") == {"one.csv": _sha(b"1\n"), "two.csv": _sha(b"22\n")}


# --------------------------------------------------------------------------- 6. transient errors (Prefect retries)


def test_transient_http_errors_are_retried_by_the_stage_task(http_store, tmp_path, prefect_api):
    from prefect import flow

    body = os.urandom(5000)
    http_store.files["/data.bin"] = (body, None)
    http_store.fail_gets["/data.bin"] = 2  # two 503s, then 200
    item = DataInput(name="remote", url=http_store.base + "/data.bin")
    task = stage_task.with_options(retries=2, retry_delay_seconds=[0.1, 0.1])

    @flow
    def run():
        return task(item, str(tmp_path / "data"))

    staged = run()
    assert (staged.copied, staged.bytes, staged.files) == (True, 5000, 1)
    assert _tree(tmp_path / "data" / "remote") == {"data.bin": _sha(body)}
    assert _leftovers(tmp_path / "data") == []
    # Each of the 3 task runs lists the URL (fsspec's HTTP `info` = one HEAD, which answers with
    # Content-Length) and GETs it; the successful run then lists once more to check that the
    # source did not change during the copy: 4 HEADs, 3 GETs.
    assert dict(http_store.seen) == {("HEAD", "/data.bin"): 4, ("GET", "/data.bin"): 3}


def _stage_in_a_flow(item: DataInput, data_dir: Path):
    """Run the stage task (2 quick retries) for ``item`` inside a flow."""
    from prefect import flow

    task = stage_task.with_options(retries=2, retry_delay_seconds=[0.1, 0.1])

    @flow
    def run():
        return task(item, str(data_dir))

    return run()


def test_missing_http_input_is_not_retried(http_store, tmp_path, prefect_api):
    url = http_store.base + "/missing.bin"
    with pytest.raises(StageError) as err:
        _stage_in_a_flow(DataInput(name="gone", url=url), tmp_path / "data")
    assert str(err.value) == f"data 'gone': {url}: not found"
    # One listing only (no retry): fsspec's HTTP `info` tries a HEAD, and when that fails
    # (404 here) falls back to a GET before raising FileNotFoundError: 1 HEAD + 1 GET.
    assert dict(http_store.seen) == {("HEAD", "/missing.bin"): 1, ("GET", "/missing.bin"): 1}
    assert not (tmp_path / "data").exists()


def test_http_refusals_are_not_reported_as_missing(http_store, tmp_path):
    """A wrong token (HTTP 401) must not read 'not found'.  fsspec raises
    FileNotFoundError for any failed request; the status it chains is said
    instead."""
    http_store.statuses.update({"/private.bin": 401, "/forbidden.bin": 403, "/broken.bin": 500})
    cases = {
        "/private.bin": "the server refused access (HTTP 401 Unauthorized); check the credentials in "
                        "storage_options (headers) or the URL's signature",
        "/forbidden.bin": "the server refused access (HTTP 403 Forbidden); check the credentials in "
                          "storage_options (headers) or the URL's signature",
        "/broken.bin": "the server answered HTTP 500 Internal Server Error",
        "/missing.bin": "not found",
    }
    for path, why in cases.items():
        url = http_store.base + path
        with pytest.raises(StageError) as err:
            preflight([DataInput(name="x", url=url)])
        assert str(err.value) == f"data 'x': {url}: {why}"
    assert not (tmp_path / "data").exists()


def test_a_download_refused_after_the_preflight_fails_once_and_says_why(http_store, tmp_path, prefect_api):
    """HEAD answers 200 and GET 401: the raw client error must not be
    retried and surfaced as a traceback-like line.  A refusal that
    retrying cannot change fails the stage at once, named."""

    http_store.files["/a.txt"] = (b"secret table", None)
    http_store.get_statuses["/a.txt"] = 401
    url = http_store.base + "/a.txt"
    with pytest.raises(StageError) as err:
        _stage_in_a_flow(DataInput(name="a", url=url), tmp_path / "data")
    assert str(err.value) == (f"data 'a': {url}: the server refused access (HTTP 401 Unauthorized); check the "
                              "credentials in storage_options (headers) or the URL's signature")
    assert http_store.seen[("GET", "/a.txt")] == 1  # not retried
    assert _leftovers(tmp_path / "data") == []


def test_local_source_changed_during_the_copy_is_copied_again(tmp_path, scanner, monkeypatch):
    """Another writer rewrites a source file while cp runs: the relisting
    after the copy sees it and the input is copied again, so the staged
    tree holds the new bytes, never the old ones with the new listing."""
    from e31.tasks.storage import transfer

    src = _make_tree(tmp_path / "src", files=12, folders=2, content=lambda i: b"old-%02d" % i)
    real_cp, copies = transfer._cp_tree, []

    def cp_then_rewrite(root, dest, progress):
        real_cp(root, dest, progress)
        copies.append(dest)
        if len(copies) == 1:  # during the first copy only
            (src / "d1" / "f3.bin").write_bytes(b"rewritten during the copy")

    monkeypatch.setattr(transfer, "_cp_tree", cp_then_rewrite)
    item, data = DataInput(name="t", url=str(src)), tmp_path / "data"
    staged = stage_input(item, data)
    assert staged.copied is True and len(copies) == 2
    assert (data / "t" / "d1" / "f3.bin").read_bytes() == b"rewritten during the copy"
    assert staged.bytes == 11 * 6 + len(b"rewritten during the copy")
    assert sorted(p.name for p in data.iterdir()) == ["t", "t.stage.json"]  # no temporary copy left


def test_local_copy_with_a_file_added_by_the_work_is_copied_again(tmp_path, scanner):
    """The staged copy must be what the source holds: a file the previous
    run's work left inside it makes the next run copy the input again."""
    src = _make_tree(tmp_path / "src", files=6, folders=2, content=lambda i: b"%d" % i)
    item, data = DataInput(name="t", url=str(src)), tmp_path / "data"
    assert stage_input(item, data).copied is True
    assert stage_input(item, data).copied is False
    (data / "t" / "d0" / "scratch.tmp").write_bytes(b"left by the work")
    again = stage_input(item, data)
    expected_copied = scanner == "find"  # the scandir fallback checks the listed files only
    assert again.copied is expected_copied
    assert (data / "t" / "d0" / "scratch.tmp").exists() is not expected_copied


def test_unchanged_compares_a_new_scan_of_a_local_folder(tmp_path):
    from e31.tasks.storage import listing as listing_module

    if listing_module._GNU_FIND is None:
        pytest.skip("no GNU find on this machine")
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x").write_bytes(b"1")
    (src / "y").write_bytes(b"22")
    listed = listing_module.list_input(str(src))
    assert len(listed.scan) == 64 and listing_module.unchanged(listed) is True
    os.utime(src / "y", ns=(5, 5))  # same size, another mtime
    assert listing_module.unchanged(listed) is False
    listed = listing_module.list_input(str(src))
    (src / "a" / "new").write_bytes(b"")
    assert listing_module.unchanged(listed) is False
    listed = listing_module.list_input(str(src))
    shutil.rmtree(src)
    assert listing_module.unchanged(listed) is False
    (tmp_path / "f.bin").write_bytes(b"f")
    single = listing_module.list_input(str(tmp_path / "f.bin"))
    assert single.scan == "" and listing_module.unchanged(single) is False  # files are listed again, not scanned


def test_a_cancelled_flow_run_stops_a_local_copy_and_keeps_the_staged_one(tmp_path):
    """The stop a cancel sets (tasks.cancel.cancel_stops_staging) ends a cp
    of a folder: nothing half-copied is left, the copy staged before stays."""
    from e31.tasks.supervisor.cancel import cancel_stops_staging
    from e31.tasks.stage import StagingCancelled

    src = _make_tree(tmp_path / "src", files=40, folders=4, content=lambda i: b"v1-%02d" % i)
    item, data = DataInput(name="t", url=str(src)), tmp_path / "data"
    assert stage_input(item, data).copied is True
    (src / "d0" / "f0.bin").write_bytes(b"changed")  # so the next stage copies
    with cancel_stops_staging(None, str(data)) as watcher:
        watcher.seen.set()  # as the watcher does when the flow run is seen cancelled
        with pytest.raises(StagingCancelled) as err:
            stage_input(item, data)
    assert str(err.value) == "data 't': staging stopped: the flow run was cancelled"
    assert _leftovers(data) == []
    assert (data / "t" / "d0" / "f0.bin").read_bytes() == b"v1-00"
    assert stage_input(item, data).copied is True  # no stop registered any more
    assert (data / "t" / "d0" / "f0.bin").read_bytes() == b"changed"
