"""Forwarding the work's stdout/stderr: rate limit, masking, partial lines,
the log cap and bounded tails (the supervisor's side, no Prefect)."""

from __future__ import annotations

import os
from pathlib import Path

from e31.tasks.supervisor import output
from e31.tasks.supervisor.output import OutputForwarder, tail_lines


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _forwarder(tmp_path: Path, **kw) -> tuple[OutputForwarder, list[tuple[str, str]], Clock]:
    got: list[tuple[str, str]] = []
    clock = Clock()
    fwd = OutputForwarder(tmp_path, emit=lambda stream, line: got.append((stream, line)), clock=clock, **kw)
    return fwd, got, clock


def test_lines_are_forwarded_in_order_with_partial_lines_held_back(tmp_path):
    fwd, got, _ = _forwarder(tmp_path)
    (tmp_path / "stdout.log").write_bytes(b"one\ntwo\nthr")
    (tmp_path / "stderr.log").write_bytes(b"warn\n")
    fwd.poll()
    assert got == [("stdout", "one"), ("stdout", "two"), ("stderr", "warn")]
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"ee\nlast-no-newline")
    fwd.finish()
    assert got[3:] == [("stdout", "three"), ("stdout", "last-no-newline")]
    assert (fwd.forwarded, fwd.dropped) == (5, 0)


def test_a_flood_is_rate_limited_and_counted(tmp_path):
    fwd, got, clock = _forwarder(tmp_path)
    (tmp_path / "stdout.log").write_bytes(b"".join(b"line %d\n" % i for i in range(10_000)))
    fwd.poll()
    assert fwd.forwarded == output.BURST_LINES and fwd.dropped == 10_000 - output.BURST_LINES
    with open(tmp_path / "stdout.log", "ab") as fh:
        fh.write(b"".join(b"more %d\n" % i for i in range(100)))
    clock.now = 1.0  # one second later: LINES_PER_S more tokens
    fwd.finish()
    assert fwd.forwarded == output.BURST_LINES + int(output.LINES_PER_S)
    assert fwd.dropped == 10_100 - fwd.forwarded
    said = [line for stream, line in got if stream == "e31"]  # said when 1,000 are held back, and at the end
    note = ("{} line(s) of the work's output not forwarded (more than 50 lines/s); the full output is in "
            f"{tmp_path}/stdout.log and stderr.log, and its last lines are in the manifest")
    assert said == [note.format(10_000 - output.BURST_LINES), note.format(100 - int(output.LINES_PER_S))]


def test_long_lines_are_cut_and_lines_are_masked(tmp_path):
    fwd, got, _ = _forwarder(tmp_path, mask=lambda s: s.replace("hunter22", "***"))
    (tmp_path / "stdout.log").write_bytes(b"x" * 5000 + b"\npassword=hunter22\n")
    fwd.poll()
    assert got[0] == ("stdout", "x" * output.MAX_LINE + f" ... [{5000 - output.MAX_LINE} characters cut]")
    assert got[1] == ("stdout", "password=***")


def test_a_log_past_its_cap_is_cut_back_and_the_child_appends_after(tmp_path, monkeypatch):
    monkeypatch.setattr(output, "LOG_CAP_BYTES", 1000)
    fwd, got, _ = _forwarder(tmp_path)
    path = tmp_path / "stdout.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # as the supervisor opens it for the child
    os.write(fd, b"a" * 99 + b"\n" * 1 + b"b" * 1999 + b"\n")
    fwd.poll()
    assert path.read_bytes() == b"a" * 99 + b"\n" + b"b" * 400  # cut back to half the cap: the head stays
    os.write(fd, b"after the cut\n")
    os.close(fd)
    fwd.finish()
    assert path.read_bytes()[500:] == b"after the cut\n"
    assert got[-1] == ("stdout", "after the cut")


def test_tail_reads_only_the_end_of_a_big_file(tmp_path):
    path = tmp_path / "stderr.log"
    with open(path, "wb") as fh:
        fh.write(b"noise\n" * 2_000_000)  # 12 MB
        fh.write(b"".join(b"last %d\n" % i for i in range(30)))
    assert tail_lines(path, 3) == "last 27\nlast 28\nlast 29"
    assert tail_lines(tmp_path / "missing.log") == ""
    assert tail_lines(path, 2, mask=lambda s: s.upper()) == "LAST 28\nLAST 29"


def test_the_working_folder_is_not_taken_for_a_secret(monkeypatch):
    """PWD is not taken for a credential: its name matches the "pwd" of
    password, and without this guard every path under the working folder
    is shown as ***."""
    from e31.tasks.storage import scrub

    monkeypatch.setenv("PWD", "/work/projects/e31")
    monkeypatch.setenv("DB_PASSWORD", "hunter2-planted")
    assert scrub("File /work/projects/e31/x.py, password hunter2-planted") == "File /work/projects/e31/x.py, password ***"
