"""SpecError and Problem: how an invalid job spec is reported."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from e31.errors import InvalidInput

__all__ = ["DOCUMENT", "Problem", "SpecError", "format_loc", "short_repr"]

#: Path used for a problem about the whole document (or the file itself).
DOCUMENT = "(spec)"

_MAX_REPR = 60


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec.

    Attributes:
        path: where: dotted field path with ``[i]`` list indexes
            (``data[0].url``), ``(spec)`` for the whole document,
            ``FILE:LINE:COLUMN`` for a syntax error, ``--set ...`` for a
            malformed override.
        message: what was expected, ``(got X)`` and a fix where there is one.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(InvalidInput):
    """An invalid job spec (or pool declaration); lists every problem found at once.

    ``str(err)`` is a header line ``invalid job spec SOURCE (N problems)``
    (``invalid pool ...`` for a pool) followed by one indented ``path: message``
    line per problem.

    Attributes:
        source: the file path as given, or a label such as ``<spec>``.
        problems: the problems, in report order (never empty).
        what: what the document is: ``job spec`` (default) or ``pool``.
    """

    def __init__(self, source: str, problems: Iterable[Problem], what: str = "job spec") -> None:
        self.source = str(source)
        self.problems: list[Problem] = list(problems)
        self.what = what
        super().__init__(self._render())

    def _render(self) -> str:
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        lines = [f"invalid {self.what} {self.source} ({count} {noun})"]
        lines.extend(f"  {problem}" for problem in self.problems)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self):  # keeps the error picklable across processes
        return (type(self), (self.source, self.problems, self.what))


def short_repr(value: object, limit: int = _MAX_REPR) -> str:
    """repr() of a value, cut to about ``limit`` characters with ``...``; an
    integer too long to print says how many digits it has."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1000:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    try:
        text = repr(value)
    except ValueError:  # e.g. an integer past Python's digit limit inside a container
        return f"a {type(value).__name__} too large to show"
    if len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def format_loc(loc: Sequence[str | int]) -> str:
    """Render a location tuple as a path: ``("data", 0, "url")`` -> ``data[0].url``."""
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or DOCUMENT
