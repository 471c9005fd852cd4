"""Forward the work's stdout and stderr to the flow run's log.

The child writes to ``stdout.log`` and ``stderr.log`` in the job's ``run/``
folder: the full record up to :data:`LOG_CAP_BYTES` each, beyond which the
file is cut back to its first half and goes on with the latest output.  The
supervisor reads what is new at each poll and logs it through Prefect's run
logger, as Prefect's ``log_prints`` does for a flow's own ``print``: it shows
in the flow run's log in the UI and, under ``e31 run``, on the terminal.

A chatty work cannot flood the API or the terminal: lines are forwarded at
most :data:`LINES_PER_S` per second on average (bursts of
:data:`BURST_LINES`) and :data:`BYTES_PER_S` bytes per second, each line cut
at :data:`MAX_LINE` characters; what is held back is counted and said
("N lines not forwarded ...").  Every forwarded line and every tail is masked
(:func:`e31.tasks.storage.masking.scrub`): credentials of storage options,
Secret-block values and credential-looking environment variables.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

LINES_PER_S = 50.0  # average forwarded lines per second (token bucket rate)
BURST_LINES = 500  # lines that may be forwarded at once after a quiet spell
BYTES_PER_S = 256 * 1024  # average forwarded bytes per second
MAX_LINE = 2000  # characters of a line that are forwarded; the rest is cut
READ_PER_POLL = 1024 * 1024  # bytes read per file per poll (the rest waits for the next poll)
TAIL_BYTES = 64 * 1024  # bytes read from the end of a file for its tail
LOG_CAP_BYTES = 256 * 1024**2  # each of stdout.log / stderr.log is cut back to its first half beyond this


def tail_lines(path: Path, lines: int = 20, mask: Callable[[str], str] = lambda s: s) -> str:
    """The last ``lines`` lines of a text file, reading at most
    :data:`TAIL_BYTES` from its end (a 1 GB log costs the same as a small
    one); '' when it cannot be read.  Each line passes through ``mask``."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - TAIL_BYTES))
            data = fh.read(TAIL_BYTES)
    except OSError:
        return ""
    text = data.decode(errors="replace").rstrip()
    kept = text.splitlines()[-lines:]
    if size > TAIL_BYTES and len(kept) == len(text.splitlines()):
        kept = kept[1:]  # the first line may be cut by the read window
    return "\n".join(mask(line) for line in kept)


@dataclass
class _Stream:
    name: str
    path: Path
    offset: int = 0
    partial: bytes = b""


@dataclass
class OutputForwarder:
    """Reads the work's ``stdout.log`` / ``stderr.log`` in ``run_dir`` and
    forwards new lines to ``emit(stream, line)`` (``stream`` is ``"stdout"``
    or ``"stderr"``), rate-limited and masked with ``mask``.

    ``forwarded`` and ``dropped`` count lines.  Call :meth:`poll` often and
    :meth:`finish` once the child has exited.  Never raises: the work's
    output must not stop a run."""

    run_dir: Path
    emit: Callable[[str, str], None]
    mask: Callable[[str], str] = lambda s: s
    clock: Callable[[], float] = time.monotonic
    forwarded: int = 0
    dropped: int = 0
    _streams: list[_Stream] = field(default_factory=list)
    _tokens: float = BURST_LINES
    _byte_tokens: float = BYTES_PER_S
    _at: float | None = None
    _dropped_said: int = 0

    def __post_init__(self) -> None:
        self._streams = [_Stream("stdout", Path(self.run_dir) / "stdout.log"),
                         _Stream("stderr", Path(self.run_dir) / "stderr.log")]

    def poll(self, final: bool = False) -> None:
        """Forward what the work wrote since the last poll (all of it, up to
        the rate limit, when ``final``), and keep each log within
        :data:`LOG_CAP_BYTES`."""
        try:
            self._refill()
            for stream in self._streams:
                self._read(stream, final)
                self._cap(stream)
            if final or self.dropped - self._dropped_said >= 1000:
                self._say_dropped()
        except Exception:  # noqa: BLE001 - forwarding is best effort
            pass

    def finish(self) -> None:
        """The child has exited: forward the rest and say what was dropped."""
        self.poll(final=True)

    def _refill(self) -> None:
        now = self.clock()
        if self._at is not None:
            elapsed = max(0.0, now - self._at)
            self._tokens = min(BURST_LINES, self._tokens + elapsed * LINES_PER_S)
            self._byte_tokens = min(BYTES_PER_S, self._byte_tokens + elapsed * BYTES_PER_S)
        self._at = now

    def _read(self, stream: _Stream, final: bool) -> None:
        """Read up to :data:`READ_PER_POLL` new bytes (when ``final``,
        everything to the end of the file) and forward the whole lines."""
        while True:
            try:
                with open(stream.path, "rb") as fh:
                    fh.seek(stream.offset)
                    data = fh.read(READ_PER_POLL)
            except OSError:
                return
            self._lines(stream, data, final and len(data) < READ_PER_POLL)
            if not final or len(data) < READ_PER_POLL:
                return

    def _lines(self, stream: _Stream, data: bytes, final: bool) -> None:
        stream.offset += len(data)
        data = stream.partial + data
        lines = data.split(b"\n")
        stream.partial = lines.pop()
        if final and stream.partial:
            lines.append(stream.partial)
            stream.partial = b""
        elif len(stream.partial) > MAX_LINE * 4:  # a line with no end yet: forward its start
            lines.append(stream.partial)
            stream.partial = b""
        for raw in lines:
            self._forward(stream.name, raw.decode(errors="replace").rstrip("\r"))

    def _forward(self, name: str, line: str) -> None:
        if len(line) > MAX_LINE:
            line = line[:MAX_LINE] + f" ... [{len(line) - MAX_LINE} characters cut]"
        if self._tokens < 1 or self._byte_tokens < len(line):
            self.dropped += 1
            return
        self._tokens -= 1
        self._byte_tokens -= len(line)
        self.forwarded += 1
        self.emit(name, self.mask(line))

    def _cap(self, stream: _Stream) -> None:
        """Cut a log that grew beyond :data:`LOG_CAP_BYTES` back to its first
        half.  The child's file is open for appending, so it goes on writing
        at the new end: the log keeps its head and up to half the cap of the
        latest output (where the manifest's tail is read)."""
        keep = LOG_CAP_BYTES // 2
        try:
            if os.stat(stream.path).st_size <= LOG_CAP_BYTES:
                return
            os.truncate(stream.path, keep)
        except OSError:
            return
        stream.offset, stream.partial = min(stream.offset, keep), b""

    def _say_dropped(self) -> None:
        if self.dropped > self._dropped_said:
            self.emit("e31", f"{self.dropped - self._dropped_said} line(s) of the work's output not forwarded "
                             f"(more than {LINES_PER_S:g} lines/s); the full output is in {self.run_dir}/stdout.log "
                             f"and stderr.log, and its last lines are in the manifest")
            self._dropped_said = self.dropped
