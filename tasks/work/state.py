"""What a checkpoint may hold, and reading one back safely.

A checkpoint's state holds tensors and plain values only, so that
``torch.load(weights_only=True)`` -- never the unsafe unpickler -- reads it
back: :func:`snapshot` checks (and copies) a state, :func:`load_state` loads one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from e31.errors import E31Error

__all__ = ["CheckpointError", "load_state", "snapshot"]


class CheckpointError(E31Error, RuntimeError):
    """A checkpoint could not be written or read (with the reason and fix)."""


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def snapshot(state: Any, copy: bool = True, path: str = "state") -> Any:
    """Check that ``state`` holds only what ``torch.load(weights_only=True)``
    reads -- tensors, numbers, strings, bytes, None, ``torch.Size``, dtypes,
    devices, and dicts/lists/tuples/sets of those -- and, with ``copy``,
    return a copy whose tensors are detached CPU clones (safe to write in the
    background while training changes the originals).

    Raises :class:`CheckpointError` naming the first offending entry, e.g.
    ``state['obj']: a Opaque is not a tensor or plain value``.
    """
    import collections

    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True) if copy else state
    # exact types: a subclass (numpy.float64 of float, an IntEnum of int) pickles as its own class
    if type(state) in _PLAIN or type(state) in (torch.Size, torch.dtype, torch.device):
        return state
    if isinstance(state, dict) and type(state) in (dict, collections.OrderedDict):
        items = {}
        for key, value in state.items():
            if type(key) not in _PLAIN:
                raise CheckpointError(f"{path}: key {key!r} is a {type(key).__name__}; use str or int keys")
            items[key] = snapshot(value, copy, f"{path}[{key!r}]")
        return type(state)(items) if copy else state
    if type(state) in (list, tuple, set):
        values = [snapshot(v, copy, f"{path}[{i}]") for i, v in enumerate(state)]
        return type(state)(values) if copy else state
    raise CheckpointError(
        f"{path}: a {type(state).__module__}.{type(state).__qualname__} is not a tensor or plain value, "
        "so torch.load(weights_only=True) could not read it back. Fix: checkpoint tensors and plain values "
        "only (e.g. model.state_dict(), optimizer.state_dict(), numbers, lists, dicts; numpy arrays via "
        "torch.from_numpy), not whole objects."
    )


def load_state(path: Path) -> Any:
    """Load a state file with ``torch.load(weights_only=True)`` (never the
    unsafe unpickler). Raises :class:`CheckpointError` when it cannot."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError or RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: {first}") from None
