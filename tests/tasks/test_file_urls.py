"""``file://`` URLs are URLs (RFC 8089): their paths are percent-decoded
(``file:///data/my%20data.csv`` is the file ``/data/my data.csv``), on the
way in (staging) and on the way out (the return), with real files on disk.
A plain path is a name and is never decoded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from urllib.parse import quote

from e31.specs import DataInput
from e31.specs.urls import file_url_path
from e31.tasks import storage
from e31.tasks.deliver import ReturnTarget, deliver
from e31.tasks.outcome import RunOutcome
from e31.tasks.stage import preflight, stage_input


def _url(path: Path, slash: str = "") -> str:
    return "file://" + quote(str(path)) + slash


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_file_url_paths_are_percent_decoded_and_plain_paths_are_not():
    assert file_url_path("file:///data/my%20data.csv") == "/data/my data.csv"
    assert file_url_path("FILE://localhost/data/100%25.csv") == "/data/100%.csv"
    assert file_url_path("file:///data/caf%C3%A9") == "/data/café"
    assert file_url_path("file:///data/%FF") == "/data/\udcff"  # not UTF-8: the same bytes on disk
    assert file_url_path("/data/my%20data.csv") is None and file_url_path("s3://b/my%20data.csv") is None
    assert storage.filesystem("file:///data/my%20data.csv")[1] == "/data/my data.csv"
    assert storage.filesystem("/data/my%20data.csv")[1] == "/data/my%20data.csv"
    assert storage.join("file:///r%20d/", "100%.txt") == "file:///r%20d/100%25.txt"
    assert storage.join("/r d/", "100%.txt") == "/r d/100%.txt"


def test_an_input_file_url_with_escapes_is_staged_from_the_file_it_names(tmp_path):
    src = tmp_path / "my data" / "my data.csv"
    src.parent.mkdir()
    src.write_bytes(b"1,2\n")
    data = tmp_path / "scratch"
    item = DataInput(name="d", url=_url(src), sha256=_sha(b"1,2\n"))
    staged = stage_input(item, data, preflight([item], data)["d"])
    assert (staged.path, staged.bytes, staged.files) == (str(data / "d" / "my data.csv"), 4, 1)
    assert (data / "d" / "my data.csv").read_bytes() == b"1,2\n"


def test_an_input_folder_url_with_escapes_is_staged_with_its_names_as_on_disk(tmp_path):
    folder = tmp_path / "in put"
    (folder / "sub dir").mkdir(parents=True)
    (folder / "100%.csv").write_bytes(b"a")
    (folder / "sub dir" / "a%20b.csv").write_bytes(b"bb")
    data = tmp_path / "scratch"
    staged = stage_input(DataInput(name="f", url=_url(folder, "/")), data)
    assert (staged.path, staged.bytes, staged.files) == (str(data / "f"), 3, 2)
    assert sorted(p.relative_to(data / "f").as_posix() for p in (data / "f").rglob("*") if p.is_file()) == [
        "100%.csv", "sub dir/a%20b.csv"]


def test_a_plain_path_is_taken_as_written(tmp_path):
    literal = tmp_path / "lit%20eral.csv"
    literal.write_bytes(b"x")
    (tmp_path / "lit eral.csv").write_bytes(b"other")
    data = tmp_path / "scratch"
    staged = stage_input(DataInput(name="p", url=str(literal)), data)
    assert Path(staged.path).read_bytes() == b"x" and Path(staged.path).name == "lit%20eral.csv"


def test_the_output_is_returned_into_the_folder_the_url_names(tmp_path):
    out = tmp_path / "scratch-out"
    (out / "sub dir").mkdir(parents=True)
    (out / "a.txt").write_bytes(b"alpha")
    (out / "100%.txt").write_bytes(b"pct")
    (out / "sub dir" / "a%20b.txt").write_bytes(b"lit")
    dest = tmp_path / "res dir"
    target = ReturnTarget(job="j", run_id="run-1", output_dir=str(out), output_url=_url(dest, "/"),
                          declared=["a.txt"], gpus=0, cpus=1, spec_sha256="s")
    manifest = deliver(target, RunOutcome(reason="finished", exit_code=0, run_s=1.0))
    assert manifest["status"] == "completed"
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "100%.txt", "a.txt", "manifest.json", "sub dir/a%20b.txt"]
    assert (dest / "sub dir" / "a%20b.txt").read_bytes() == b"lit" and (dest / "100%.txt").read_bytes() == b"pct"
    assert json.loads((dest / "manifest.json").read_text())["status"] == "completed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res dir", "scratch-out"]  # no folder named res%20dir
