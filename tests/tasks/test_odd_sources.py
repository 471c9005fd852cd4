"""Sources as people have them: a file whose name holds glob characters,
S3 "folder marker" objects, and HTTP bodies whose size is not said."""

from __future__ import annotations

import gzip
import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from e31.specs import DataInput
from e31.tasks.stage import stage_input
from e31.tasks.storage.listing import UNKNOWN_SIZE, list_input


def test_an_existing_file_whose_name_looks_like_a_pattern_is_that_file(tmp_path):
    """data/run[1].csv, an existing file, is not taken as a pattern (with
    run1.csv beside it, the other file was staged)."""
    (tmp_path / "run[1].csv").write_text("the literal one\n")
    (tmp_path / "run1.csv").write_text("the pattern's match\n")
    listing = list_input(str(tmp_path / "run[1].csv"))
    assert (listing.kind, [e.rel for e in listing.entries]) == ("file", ["run[1].csv"])
    staged = stage_input(DataInput(name="runs", url=str(tmp_path / "run[1].csv")), tmp_path / "data")
    assert Path(staged.path).read_text() == "the literal one\n"
    glob = list_input(str(tmp_path / "run[0-9].csv"))  # nothing has this name: a pattern
    assert (glob.kind, [e.rel for e in glob.entries]) == ("glob", ["run1.csv"])


def test_s3_folder_markers_are_folders(s3_server, s3_prefix, tmp_path):
    """Zero-byte keys ending in '/' are folders, not files (listed as files,
    staging failed with 'day1/: missing after the copy')."""
    fs = s3_server.filesystem()
    root = s3_prefix.removeprefix("s3://") + "frames"
    fs.pipe({f"{root}/": b"", f"{root}/day1/": b"", f"{root}/day1/a.txt": b"a", f"{root}/empty/": b"",
             f"{root}/day2/b.txt": b"bb"})
    listing = list_input(s3_prefix + "frames/")
    assert [e.rel for e in listing.entries] == ["day1/a.txt", "day2/b.txt"]
    assert listing.dirs == ["empty"]
    staged = Path(stage_input(DataInput(name="frames", url=s3_prefix + "frames/"), tmp_path / "data").path)
    assert sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*")) == [
        "day1", "day1/a.txt", "day2", "day2/b.txt", "empty"]


BODY = b"x,y\n" + b"".join(b"%d,%d\n" % (i, i * i) for i in range(5000))


@pytest.fixture
def odd_http():
    """An HTTP server that refuses HEAD and sends /chunked.csv chunked with no
    Content-Length, and /gzip.csv gzip-encoded."""

    class Odd(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_HEAD(self):
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            self.send_response(200)
            if self.path.startswith("/gzip"):
                data = gzip.compress(BODY)
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(BODY), 4096):
                chunk = BODY[start:start + 4096]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("path", ["/chunked.csv", "/gzip.csv"])
def test_a_source_of_unknown_size_is_streamed_and_checked_by_its_sha256(odd_http, tmp_path, path):
    """Such sources are not listed as 0 B (guards against '64273 bytes
    copied, the source has 0 (3 attempts)')."""
    listing = list_input(odd_http + path)
    assert listing.size_unknown and listing.entries[0].size == UNKNOWN_SIZE
    item = DataInput(name="table", url=odd_http + path, sha256=hashlib.sha256(BODY).hexdigest())
    staged = stage_input(item, tmp_path / "data")
    assert Path(staged.path).read_bytes() == BODY
    bad = DataInput(name="bad", url=odd_http + path, sha256="0" * 64)
    from e31.tasks.stage import StageError

    with pytest.raises(StageError, match="sha256 mismatch"):
        stage_input(bad, tmp_path / "data")


def test_every_s3_read_of_a_staged_object_is_pinned_to_its_listed_version(s3_server, s3_prefix, tmp_path):
    """An object replaced v1 -> v2 -> v1 while its download resumes with a
    Range request must not be staged as a splice.  Every GET of an object
    being staged carries If-Match with the ETag it was listed with: another
    version answers 412 and is listed and copied again, whole."""
    from e31.tasks import storage
    from e31.tasks.storage import s3session

    url = s3_prefix + "model.bin"
    fs, path = storage.filesystem(url)
    fs.pipe_file(path, b"1" * 1000)
    v1 = list_input(url)
    with s3session.pinned({path: v1.entries[0].etag}):
        assert fs.cat_file(path) == b"1" * 1000
    fs.pipe_file(path, b"2" * 1000)  # replaced after it was listed
    with s3session.pinned({path: v1.entries[0].etag}):
        with pytest.raises(OSError, match="pre-conditions you specified did not hold"):
            fs.cat_file(path)
    staged = stage_input(DataInput(name="m", url=url), tmp_path / "data", listing=v1)
    assert Path(staged.path).read_bytes() == b"2" * 1000  # the version now there, whole


@pytest.mark.parametrize("kind", ["file", "glob", "folder of one"])
def test_a_file_added_to_any_staged_input_means_staging_it_again(tmp_path, kind):
    """A file the work adds to a staged glob input or a one-file folder
    input means the input is staged again, not reused by the next run."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.csv").write_text("a\n")
    url = {"file": str(src / "a.csv"), "glob": str(src / "*.csv"), "folder of one": str(src)}[kind]
    item = DataInput(name="inp", url=url)
    assert stage_input(item, tmp_path / "data").copied is True
    staged_root = tmp_path / "data" / "inp"
    (staged_root / "injected.csv").write_text("EVIL\n")
    again = stage_input(item, tmp_path / "data")
    assert again.copied is True and not (staged_root / "injected.csv").exists()
