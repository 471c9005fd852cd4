"""The work's side of a run: the context object a Python entrypoint receives.

The supervisor (``e31.tasks.run``) writes a :class:`ChildConfig` to a JSON file
and starts ``python -m e31.tasks.work.child CONFIG``; the child builds a
:class:`WorkContext` from it and calls the entrypoint with it.  A ``command``
gets the same information through ``E31_*`` environment variables
(:func:`command_environment`).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from e31.tasks.work import local_checkpoints as checkpoints
from e31.tasks.work.rendezvous import PORTS_VAR, Rendezvous, free_port, port_range


@dataclass
class ChildConfig:
    """Everything the child process needs, serialisable to JSON.

    Paths are local and absolute.  ``checkpoint_every_s`` is in seconds.
    ``supervised``: a supervisor process commits the work's checkpoints.
    ``master_addr``, ``master_port``, ``node_rank``, ``nnodes``, ``interface``: where the run's ranks meet
    (:class:`e31.tasks.work.rendezvous.Rendezvous`); ``master_port`` 0: a free port is taken when
    the child's environment is made.  ``try_token``: the try of a job of several nodes this work is
    (the lead's rendezvous token), written into its sharded checkpoints.
    """

    entrypoint: str | None
    command: list[str] | None
    params: dict[str, Any]
    data: dict[str, str]
    output_dir: str
    checkpoint_dir: str
    progress_file: str
    device: str
    cpus: int
    gpus: int
    code_dirs: list[str] = field(default_factory=list)
    checkpoint_every_s: float | None = None
    checkpoint_every_steps: int | None = None
    supervised: bool = False
    devices: list[int] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    node_rank: int = 0
    nnodes: int = 1
    interface: str | None = None
    try_token: str | None = None

    def rendezvous(self) -> Rendezvous:
        """Where this run's ranks meet; a free port on ``master_addr`` when none was chosen
        (:func:`e31.tasks.work.rendezvous.free_port`; within ``E31_RENDEZVOUS_PORTS`` for a job of
        several nodes, whose ranks meet through the cluster's network: one node's meet on its
        loopback, where any port does).  Raises ``RendezvousError`` when no port is free."""
        ports = port_range(os.environ.get(PORTS_VAR)) if self.nnodes > 1 else None
        port = self.master_port or free_port(self.master_addr, ports)
        return Rendezvous(self.master_addr, port, self.node_rank, self.nnodes, self.interface)

    def write(self, path: Path) -> None:
        """Write this config as JSON to ``path``."""
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, path: Path) -> "ChildConfig":
        """Read a config written by :meth:`write`."""
        return cls(**json.loads(Path(path).read_text()))


def command_environment(cfg: ChildConfig) -> dict[str, str]:
    """The ``E31_*`` variables (and thread/device variables) a child gets.

    ``E31_DATA_<NAME>`` per input (name upper-cased, ``-`` and ``.`` as
    ``_``), ``E31_OUTPUT_DIR``, ``E31_CHECKPOINT_DIR``, ``E31_RESUME_DIR``
    (newest valid checkpoint folder, empty when none), ``E31_PROGRESS_FILE``,
    ``E31_DEVICE``, ``E31_PARAMS`` (JSON), ``OMP_NUM_THREADS`` and
    ``MKL_NUM_THREADS`` (= cpus) and ``CUDA_VISIBLE_DEVICES`` (``0..gpus-1``,
    empty for a CPU job, so a CPU job never touches a GPU), and the
    rendezvous of its ranks, torch's names and E31's (``MASTER_ADDR``,
    ``RANK``, ``E31_NNODES``, ...: :mod:`e31.tasks.work.rendezvous`).
    Raises ``RendezvousError`` when ``E31_RENDEZVOUS_PORTS`` is malformed or
    all its ports are taken.
    """
    env = {
        "E31_OUTPUT_DIR": cfg.output_dir,
        "E31_CHECKPOINT_DIR": cfg.checkpoint_dir,
        "E31_PROGRESS_FILE": cfg.progress_file,
        "E31_DEVICE": cfg.device,
        "E31_PARAMS": json.dumps(cfg.params),
        "OMP_NUM_THREADS": str(cfg.cpus),
        "MKL_NUM_THREADS": str(cfg.cpus),
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in (cfg.devices if cfg.devices is not None else range(cfg.gpus))),
    }
    env.update(cfg.rendezvous().environment())
    latest = checkpoints.latest_valid(Path(cfg.checkpoint_dir))
    env["E31_RESUME_DIR"] = str(latest.path) if latest else ""
    for name, path in cfg.data.items():
        env["E31_DATA_" + name.upper().replace("-", "_").replace(".", "_")] = path
    return env


class WorkContext:
    """What a Python entrypoint ``def train(ctx): ...`` receives.

    Attributes: ``data`` (input name -> local path of the staged copy),
    ``output_dir`` (``Path`` where output files go), ``params`` (the spec's
    ``work.params``), ``device`` (``"cuda"`` when GPUs were granted, else
    ``"cpu"``), ``cpus`` (threads to use), ``rank`` and ``world_size`` (this
    node's rank and the job's ranks, one per node: 0 and 1 on a single-node
    job), ``is_lead`` (rank 0).  The rendezvous is in the environment
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), so
    ``torch.distributed.init_process_group(backend)`` needs no other argument.
    """

    def __init__(self, cfg: ChildConfig):
        self._cfg = cfg
        self.data: dict[str, Path] = {k: Path(v) for k, v in cfg.data.items()}
        self.output_dir = Path(cfg.output_dir)
        self.params: dict[str, Any] = dict(cfg.params)
        self.device: str = cfg.device
        self.cpus: int = cfg.cpus
        self.rank: int = cfg.node_rank
        self.world_size: int = cfg.nnodes
        self._checkpoint_dir = Path(cfg.checkpoint_dir)
        self._stop = False
        self._stop_noted = False
        self._last_checkpoint_time = time.monotonic()
        self._last_checkpoint_step: int | None = None
        self._last_folder: Path | None = None
        self.output_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def local(
        cls,
        data: dict[str, str | Path],
        output_dir: str | Path,
        params: dict[str, Any] | None = None,
        checkpoint_dir: str | Path | None = None,
        device: str = "cpu",
        cpus: int = 1,
        checkpoint_every_steps: int | None = None,
    ) -> "WorkContext":
        """A context for calling a work function as plain Python, without a
        queue (to try work locally, in tests, and as the benchmark baseline).
        Checkpoints go to ``checkpoint_dir`` (default ``<output_dir>/.checkpoints``)."""
        output_dir = Path(output_dir)
        ckpt = Path(checkpoint_dir) if checkpoint_dir else output_dir / ".checkpoints"
        cfg = ChildConfig(
            entrypoint=None, command=None, params=dict(params or {}),
            data={k: str(v) for k, v in data.items()}, output_dir=str(output_dir),
            checkpoint_dir=str(ckpt), progress_file=str(ckpt.parent / ".progress.json"),
            device=device, cpus=cpus, gpus=1 if device.startswith("cuda") else 0,
            checkpoint_every_steps=checkpoint_every_steps,
        )
        return cls(cfg)

    @property
    def is_lead(self) -> bool:
        """True on rank 0, the lead node: the rank whose output comes back."""
        return self.rank == 0

    # -- stopping -------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """Turn SIGTERM (the supervisor's stop warning) into ``should_stop``."""
        signal.signal(signal.SIGTERM, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        self._stop = True

    @property
    def should_stop(self) -> bool:
        """True once the supervisor warned that the run must end (time limit,
        deadline, cancellation, preemption): save a checkpoint and return.
        (Work that never reads it as true and finishes anyway counts as
        finished.)"""
        if self._stop and not self._stop_noted:
            self._stop_noted = True
            Path(self._cfg.progress_file).with_name("stop_seen").write_text("1")
        return self._stop

    # -- checkpoints ----------------------------------------------------
    def restore(self) -> tuple[Any, int] | None:
        """``(state, step)`` of the newest verified checkpoint, or None on a
        fresh start.  Loaded with ``torch.load(weights_only=True)``; raises
        ``CheckpointError`` for a state that would need arbitrary classes."""
        self.flush()
        latest = checkpoints.latest_valid(self._checkpoint_dir)
        if latest is None:
            return None
        state = checkpoints.load_state(latest.path / checkpoints.STATE_FILE)
        self._last_checkpoint_step = latest.step
        return state, latest.step

    def checkpoint(self, state: dict[str, Any], step: int, wait: bool = False) -> None:
        """Save ``state`` (tensors and plain values) as the checkpoint of
        ``step`` and go on working.

        The work's process only serialises and writes it (hashing on the way,
        no fsync); the supervisor -- another process, so training does not
        wait on the disk -- makes it durable, commits it and uploads it.
        Without a supervisor (:meth:`local`) it is committed here.
        ``wait=True`` returns only once it is committed.  Raises
        ``CheckpointError`` for a state not loadable with ``weights_only=True``.
        """
        folder = checkpoints.write_state(self._checkpoint_dir, state, int(step), handoff=self._cfg.supervised)
        self._written(folder, step, wait)

    def checkpoint_sharded(self, state: dict[str, Any], step: int, wait: bool = False) -> None:
        """Save this rank's part of the checkpoint of ``step`` with ``torch.distributed.checkpoint``
        (``state``: a ``state_dict`` of tensors -- ``DTensor`` and FSDP's sharded ones included -- and
        plain values) and go on working.  A collective: every rank calls it with the same ``step``, after
        ``torch.distributed.init_process_group``.  Each rank's process makes its part durable at the
        checkpoint URL; the checkpoint counts once every rank's part has landed there
        (:mod:`e31.tasks.work.sharded`).  ``wait=True`` returns once this rank's part is committed on
        its node.  Raises ``CheckpointError`` naming what DCP could not save."""
        from e31.tasks.work import sharded

        folder = sharded.save(self._checkpoint_dir, state, int(step), self.rank, self.world_size,
                              self._cfg.try_token)
        self._written(folder, step, wait)

    def restore_sharded(self, state: dict[str, Any]) -> int | None:
        """Load the newest whole checkpoint saved with :meth:`checkpoint_sharded` into ``state`` in place
        (each tensor its own slice: ``torch.distributed.checkpoint.load``, a collective) and return its
        step; None on a fresh start (``state`` untouched).  Every rank gets the same step.  Raises
        ``CheckpointError`` when the newest checkpoint was saved with :meth:`checkpoint`."""
        from e31.tasks.work import sharded

        self.flush()
        latest = checkpoints.latest_valid(self._checkpoint_dir)
        if latest is None:
            return None
        sharded.load(latest.path, state)
        self._last_checkpoint_step = latest.step
        return latest.step

    def _written(self, folder: Path, step: int, wait: bool) -> None:
        """The checkpoint of ``step`` was written into ``folder``: commit it here without a supervisor,
        note it, and with ``wait`` return once it is committed."""
        if not self._cfg.supervised:
            checkpoints.commit(folder)
        self._last_folder = folder
        self._last_checkpoint_time = time.monotonic()
        self._last_checkpoint_step = int(step)
        if wait:
            self.flush()

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait (at most ``timeout_s`` seconds) until the last checkpoint is
        committed; raises ``CheckpointError`` when it is not."""
        folder = self._last_folder
        if folder is None:
            return
        deadline = time.monotonic() + timeout_s
        while not (folder / checkpoints.MARKER).is_file():
            if time.monotonic() > deadline or not checkpoints.written(folder):
                raise checkpoints.CheckpointError(f"{folder}: not committed within {timeout_s:g} s")
            time.sleep(0.02)

    @staticmethod
    def rng_state() -> dict[str, Any]:
        """The random number generators' states (Python, NumPy when
        installed, torch CPU and CUDA) as tensors and plain values, to put in
        a checkpoint so a resumed run draws the same numbers."""
        import random

        import torch

        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
        except ImportError:
            pass
        return state

    @staticmethod
    def set_rng_state(state: dict[str, Any]) -> None:
        """Restore the generators from :meth:`rng_state`'s result."""
        import random

        import torch

        random.setstate(tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        if "numpy" in state:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))

    def checkpoint_due(self, step: int) -> bool:
        """True when the spec's checkpoint policy (``every_steps`` or ``every``
        seconds since the last checkpoint) asks for a checkpoint at ``step``,
        or when the run must stop."""
        if self._stop:
            return True
        every_steps = self._cfg.checkpoint_every_steps
        if every_steps:
            return step % every_steps == 0
        every_s = self._cfg.checkpoint_every_s
        if every_s:
            return time.monotonic() - self._last_checkpoint_time >= every_s
        return False

    # -- progress -------------------------------------------------------
    def progress(self, done: float, total: float | None = None, **metrics: float) -> None:
        """Report progress (``done`` of ``total`` units, e.g. epochs) and
        optional scalar metrics; shown in the CLI and the Prefect UI."""
        record = {"done": done, "total": total, "metrics": metrics, "time": time.time()}
        path = Path(self._cfg.progress_file)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
