"""``file:`` URLs as RFC 8089 writes them: the one-slash form is a URL, a host other than this machine
is refused, a ``%`` that starts no escape is refused (through the real ``e31 validate``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SPEC = """\
name: j
work: {{kind: processing, command: ["true"]}}
request: {{limit: 1m}}
output: {{kind: files, url: "{url}", files: [a]}}
"""


def validate(tmp_path: Path, url: str) -> subprocess.CompletedProcess:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(url=url))
    return subprocess.run([str(Path(sys.executable).with_name("e31")), "validate", str(spec)], text=True,
                          capture_output=True, timeout=120)


def test_the_one_slash_form_is_an_absolute_file_url(tmp_path):
    out = validate(tmp_path, f"file:{tmp_path}/out/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith(f"output files -> file://{tmp_path}/out/")


def test_a_file_url_naming_another_host_is_refused(tmp_path):
    out = validate(tmp_path, "file://otherhost/tmp/x/")
    assert out.returncode == 2
    assert out.stderr.splitlines()[1:] == [
        "  output.url: a file:// URL names a file on this machine: its host must be empty or localhost (got host "
        "'otherhost'); write file:///otherhost/tmp/x/ (three slashes) for an absolute path, or a plain path; for "
        "another machine's files use a protocol it serves (s3://, http://, ...)"]
    assert validate(tmp_path, f"file://localhost{tmp_path}/out/").returncode == 0


def test_a_percent_that_starts_no_escape_is_refused(tmp_path):
    out = validate(tmp_path, "file:///tmp/sp%zzace/")
    assert out.returncode == 2
    assert out.stderr.splitlines()[1:] == [
        "  output.url: a % in a file:// URL must start an escape of two hex digits (RFC 3986) (got '%zz' at "
        "character 15); write %25 for a literal %, or give a plain path"]
    assert validate(tmp_path, "file:///tmp/a%20b/").returncode == 0
    assert validate(tmp_path, "/tmp/100%/").returncode == 0  # a plain path is a name: its % is a %


def test_a_nul_in_a_decoded_path_is_named_with_its_field_beside_the_other_problems(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text('name: j\nwork: {kind: processing, command: ["true"]}\nrequest: {limit: 1m}\n'
                    'data: [{name: d, url: "file:///tmp/a.txt%00.png"}]\n'
                    'output: {kind: files, url: "file:///tmp/o%00ut/", files: []}\n')
    out = subprocess.run([str(Path(sys.executable).with_name("e31")), "validate", str(spec)], text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 2
    hidden = ("must not hold control characters or bidirectional-text controls: a name holding them shows "
              "differently from what it is (got U+0000 (a control character) at character {} of its decoded path); "
              "remove it and write the name with visible characters only")
    assert out.stderr.splitlines()[1:] == [
        "  data[0].url: " + hidden.format(11), "  output.url: " + hidden.format(7),
        "  output.files: must list at least one file (got []); list the files whose existence marks the job "
        "complete, e.g. [model.pt, metrics.json]"]
