"""E31's tuning settings, read from ``E31_*`` environment variables.

:func:`value` never raises (a setting that does not parse gives its default,
so importing a module never fails); :func:`check` raises
:class:`SettingsError` naming the first bad variable, what it must be and
what it got.  The CLI and the flow call :func:`check` before anything runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from e31.errors import InvalidInput


class SettingsError(InvalidInput):
    """An ``E31_*`` environment variable holds a value E31 cannot use."""


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class Setting:
    """One variable: ``kind`` int or float, its ``default`` and the range
    ``[low, high]`` it must lie in (``low_open``: strictly above ``low``)."""

    kind: type
    default: float
    low: float
    high: float
    what: str
    low_open: bool = False

    def parse(self, name: str, text: str) -> float:
        """The value of ``text``; raises :class:`SettingsError` naming ``name``."""
        try:
            got = self.kind(text.strip())
        except ValueError:
            got = None
        bad = (got is None or (isinstance(got, float) and not math.isfinite(got)) or got > self.high
               or got < self.low or (self.low_open and got == self.low))
        if bad:
            low = f"above {self.low:g}" if self.low_open else f"at least {self.low:g}"
            raise SettingsError(f"{name} must be {'a whole number' if self.kind is int else 'a number'} of {self.what}, "
                                f"{low} and at most {self.high:g} (got {text!r}); unset it for the default "
                                f"{self.default:g}")
        return got


#: Every tuning variable, its kind, default and allowed range.
SETTINGS: dict[str, Setting] = {
    "E31_TRANSFER_RETRIES": Setting(int, 3, 0, 100, "retries"),
    "E31_TRANSFER_BACKOFF_S": Setting(float, 2.0, 0, 3600, "seconds"),
    "E31_TRANSFER_BATCH": Setting(int, 32, 1, 1024, "concurrent transfers"),
    "E31_STREAMS_PER_FILE": Setting(int, max(1, min(10, _cores() // 2)), 1, 64, "streams"),
    "E31_STAGE_RATE_MIBS": Setting(float, 200.0, 0, 1e7, "MiB/s", low_open=True),
    "E31_STORE_CONNECT_TIMEOUT_S": Setting(float, 10.0, 0, 3600, "seconds", low_open=True),
    "E31_STORE_READ_TIMEOUT_S": Setting(float, 60.0, 0, 3600, "seconds", low_open=True),
    "E31_API_TIMEOUT_S": Setting(float, 15.0, 1, 3600, "seconds"),  # below 1 s a healthy server looks frozen
}


def value(name: str):
    """The setting ``name`` from the environment, or its default when unset
    or unusable (:func:`check` reports unusable ones)."""
    setting = SETTINGS[name]
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return setting.default
    try:
        return setting.parse(name, text)
    except SettingsError:
        return setting.default


def check() -> None:
    """Raise :class:`SettingsError` for the first set ``E31_*`` tuning
    variable that does not parse or lies outside its range (and for an
    ``E31_RENDEZVOUS_PORTS`` that is not a port range:
    :func:`e31.tasks.work.rendezvous.port_range`)."""
    for name, setting in SETTINGS.items():
        text = os.environ.get(name)
        if text is not None and text.strip() != "":
            setting.parse(name, text)
    from e31.tasks.work.rendezvous import PORTS_VAR, RendezvousError, port_range

    try:
        port_range(os.environ.get(PORTS_VAR))
    except RendezvousError as exc:
        raise SettingsError(str(exc)) from None
