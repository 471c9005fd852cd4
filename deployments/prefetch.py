"""Prefetch: stage a queued job's inputs on the node it is planned on,
before the job is allocated, so its compute does not sit idle while they
copy.

``e31 worker`` starts this as a child process (``python -m
e31.deployments.prefetch --pool POOL.yaml --node NAME``, at the lowest CPU
and I/O priority; it dies with the worker) when its node declares a
``scratch_budget`` in the pool file.  Each pass (every
:data:`PREFETCH_EVERY_S` seconds) reads the pool's soonest queued flow runs
and takes those the scheduler planned on this node (their ``placement``
names it: :func:`e31.flows.queue.planned_start`), soonest
first, one at a time:

1. the run's inputs are listed (``preflight``); when all are staged and
   unchanged there is nothing to do;
2. the least recently used staged copies of other jobs are evicted until
   this job's inputs fit the node's ``scratch_budget``
   (:func:`e31.tasks.storage.scratch_cache.evict`); never a copy a run or a
   prefetch is using, nor one of a job placed here or planned here sooner; a job that
   cannot fit is skipped until room is freed;
3. each input is staged into the job's own scratch (``<root>/<job>/data``)
   by :func:`e31.tasks.stage.stage_input`, as the run itself would, through
   a temporary folder renamed into place when whole and verified: a prefetch
   killed at any moment leaves no copy that a run would reuse.

While it copies, a :class:`Gate` pauses it whenever a flow run on this
machine is staging or returning, caps its rate (``E31_PREFETCH_RATE`` bytes/s), and
stops it within a chunk when the job's own run wants its data folder or
the run left the queue.  Its progress is a Prefect progress artifact on the
flow run ("inputs 3.2 GiB of 10.0 GiB staged on n2"), which ``e31 queue``
shows.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e31.deployments.prefetch_runs import planned_here, starting_here, tag_staged, untag_staged

#: Seconds between passes over the queue.
PREFETCH_EVERY_S = 3.0
#: Seconds between the gate's checks of the yield request and of the node's transfers.
CHECK_EVERY_S = 0.2
#: Seconds before a run whose prefetch failed (an input missing, unreadable) is tried again.
RETRY_FAILED_S = 60.0


from e31.deployments.prefetch_report import PROGRESS_PREFIX, _Progress, _Watch, progress_of  # noqa: E402,F401 (progress_of: e31 queue)


class Yielded(Exception):
    """A prefetch stopped: the job's own run wants its data folder, or the run left the queue."""


@dataclass
class Gate:
    """Called by each staging transfer of a prefetch with the bytes it has
    done (see :class:`e31.tasks.storage.progress.TransferProgress`).

    It raises :class:`e31.tasks.storage.progress.TransferStopped` once
    ``stop()`` says so (checked every :data:`CHECK_EVERY_S` s), sleeps while
    ``busy()`` (a flow run on the node is staging or returning), and sleeps
    as needed to keep the average rate at most ``rate`` bytes/s (None: no
    cap).  ``done`` is the current transfer's bytes (for progress)."""

    stop: Any
    busy: Any
    rate: float | None = None
    done: int = 0
    paused_s: float = 0.0  # seconds paused for others' transfers, over every transfer
    _started: float = field(default_factory=time.monotonic)
    _checked: float = 0.0
    _paused_before: float = 0.0  # paused_s when the current transfer started

    def __call__(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if now - self._checked >= CHECK_EVERY_S:
            self._checked = now
            self._check()
            while self.busy():
                time.sleep(CHECK_EVERY_S)
                self.paused_s += CHECK_EVERY_S
                self._check()
        while self.rate:  # in short sleeps: a yield is seen within CHECK_EVERY_S
            ahead = done / self.rate - (time.monotonic() - self._started - (self.paused_s - self._paused_before))
            if ahead <= 0:
                break
            time.sleep(min(ahead, CHECK_EVERY_S))
            self._check()

    def _check(self) -> None:
        from e31.tasks.storage.progress import TransferStopped

        if self.stop():
            raise TransferStopped("the prefetch yielded")

    def reset(self) -> None:
        """A new transfer starts (its byte count starts from 0)."""
        self.done, self._started, self._paused_before = 0, time.monotonic(), self.paused_s


@dataclass
class Result:
    """What one prefetch of a flow run did: ``outcome`` (``copied``,
    ``staged`` -- all inputs were already there --, ``busy``, ``over
    budget``, ``yielded``, ``failed``), bytes copied, seconds, and the
    copies ``evicted`` to make room (``job/input`` names)."""

    run_id: str
    job: str
    outcome: str
    copied_bytes: int = 0
    seconds: float = 0.0
    staging_s: float = 0.0
    evicted: list[str] = field(default_factory=list)
    detail: str = ""


class Prefetcher:
    """Prefetches for one node: ``root`` its scratch root, ``budget`` the
    bytes of staged copies its scratch may hold (the pool file's
    ``scratch_budget``), ``rate`` a cap in bytes/s (None: none)."""

    def __init__(self, pool: Any, node: str, budget: int, root: Path, rate: float | None = None,
                 report: Any = None) -> None:
        self.pool, self.node, self.budget, self.root, self.rate = pool, node, budget, Path(root), rate
        self.report = report or (lambda line: print(line, flush=True))
        self.finished: dict[str, str] = {}  # flow run id -> job: runs whose inputs are all staged here
        self.said: dict[str, tuple[str, str]] = {}  # flow run id -> the last outcome reported (each change is said once)
        self.later: dict[str, float] = {}  # flow run id -> monotonic time before which a failed one is not retried

    def pass_once(self, client: Any) -> list[Result]:
        """One pass: prefetch each queued run planned here, soonest first."""
        results, sooner = [], set(starting_here(client, self.pool, self.node))
        planned = planned_here(client, self.pool, self.node)
        ids = {str(r.id) for r in planned}  # what is kept of runs no longer planned here is let go
        self.finished = {k: v for k, v in self.finished.items() if k in ids}
        self.said = {k: v for k, v in self.said.items() if k in ids}
        self.later = {k: v for k, v in self.later.items() if k in ids}
        for run in planned:
            job = str(((run.parameters or {}).get("spec") or {}).get("name"))
            if str(run.id) in self.finished or self.later.get(str(run.id), 0.0) > time.monotonic():
                sooner.add(job)
                continue
            result = self.prefetch(client, run, keep=frozenset(sooner))
            sooner.add(job)
            results.append(result)
            if result.outcome in ("copied", "staged"):
                self.finished[str(run.id)] = result.job
                if self.plans_inputs(run):
                    tag_staged(client, str(run.id), self.node, result.staging_s)
            gone = {name.split("/", 1)[0] for name in result.evicted}  # their runs are prefetched again in turn
            for other in [r for r, j in self.finished.items() if j in gone]:
                del self.finished[other]
                untag_staged(client, other, self.node)  # the scheduler no longer counts this node for it
            if result.outcome == "failed":
                self.later[str(run.id)] = time.monotonic() + RETRY_FAILED_S
            if result.outcome != "staged" and (result.outcome, result.detail) != self.said.get(str(run.id)):
                self.said[str(run.id)] = (result.outcome, result.detail)
                self.report(_line(self.node, result))
                if result.outcome == "over budget":  # e31 queue and the UI say it too
                    _Progress(str(run.id), self.node, 0, 0).said(
                        f"{PROGRESS_PREFIX}not prefetched on {self.node}: {result.detail}; they stage when it starts")
        return results

    @staticmethod
    def plans_inputs(run: Any) -> bool:
        """Whether the run's job reads any data (a job without inputs has nothing staged to prefer a node for)."""
        return bool(((run.parameters or {}).get("spec") or {}).get("data"))

    def prefetch(self, client: Any, run: Any, keep: frozenset[str] = frozenset()) -> Result:
        """Stage the inputs of the queued flow run ``run`` here (see the
        module docstring); the staged copies of the jobs in ``keep`` (runs
        planned here sooner) are not evicted for it."""
        from e31.flows.compile import compile_plan
        from e31.flows.queue.mapping import stored_spec
        from e31.tasks.stage import Reused, StagingCancelled, preflight, stage_input, staged_now
        from e31.tasks.storage.options import register_inputs
        from e31.tasks.storage.scratch_cache import evict, note_prefetch, remove_torn, try_hold_data
        from e31.tasks.supervisor.cancel import gate_staging

        started = time.monotonic()
        key = str(run.id)
        try:
            spec = stored_spec(run)  # as of its submission
        except Exception as exc:
            return Result(key, "?", "failed", detail=f"not a job spec ({type(exc).__name__})")
        plan = compile_plan(spec, scratch_root=self.root)
        result = Result(key, spec.name, "staged")
        if not plan.inputs:
            return result
        scratch = Path(plan.scratch)
        with try_hold_data(scratch) as held:
            if not held:
                result.outcome, result.detail = "busy", "its data folder is in use (a run of the job)"
                return result
            plan.data_dir.mkdir(parents=True, exist_ok=True)
            remove_torn(plan.data_dir)
            try:
                register_inputs(spec)
                listings = preflight(plan.inputs, plan.data_dir)
            except Exception as exc:  # the run itself will say why, when it starts
                result.outcome, result.detail = "failed", _why(exc)
                return result
            todo = [i for i in plan.inputs if not isinstance(listings[i.name], Reused)
                    and not staged_now(i, listings[i.name], plan.data_dir)]
            need = sum(listings[i.name].bytes for i in todo)
            if not todo:
                return result
            keep = {spec.name, *keep, *starting_here(client, self.pool, self.node)}  # placed since the pass began
            fits, evicted = evict(self.root, need, self.budget, keep=keep)
            result.evicted = [f"{c.job}/{c.name}" for c in evicted]
            if not fits:
                result.outcome = "over budget"
                result.detail = (f"its inputs to copy ({_size(need)}) do not fit the node's scratch_budget "
                                 f"({_size(self.budget)}) beside the copies in use")
                return result
            total = sum(x.bytes for x in listings.values())
            progress = _Progress(key, self.node, total, total - need)
            still_queued = _Watch(key)
            gate = Gate(stop=lambda: _stop_wanted(scratch) or not still_queued.ok(), busy=_busy,
                        rate=self.rate)
            try:
                with gate_staging(str(plan.data_dir), gate), progress.running(gate):
                    for item in todo:
                        if not still_queued.ok(fresh=True) or _stop_wanted(scratch):
                            raise Yielded()
                        gate.reset()
                        staged = stage_input(item, plan.data_dir, listings[item.name])
                        progress.finished(item.name, staged.bytes)
                        result.copied_bytes += staged.bytes if staged.copied else 0
            except (Yielded, StagingCancelled):
                result.outcome, result.detail = "yielded", "its run started, or it left the queue"
                return result
            except Exception as exc:  # the run will stage it itself, and say why when it cannot
                result.outcome, result.detail = "failed", _why(exc)
                return result
            finally:
                still_queued.close()
            result.seconds = time.monotonic() - started
            result.staging_s = max(0.0, result.seconds - gate.paused_s)  # what the copy takes, without its pauses
            result.outcome = "copied"
            progress.done(result.seconds)
            note_prefetch(plan.data_dir, key, self.node, result.seconds, result.copied_bytes)
        return result


def _stop_wanted(scratch: Path) -> bool:
    from e31.tasks.storage.scratch_cache import yield_wanted

    return yield_wanted(scratch)


def _busy() -> bool:
    from e31.tasks.storage.transfer_markers import transfers_busy

    return transfers_busy()


def _why(exc: BaseException) -> str:
    from e31.tasks.storage import scrub

    return scrub(str(exc))[:300] or type(exc).__name__


def _size(n: float) -> str:
    from e31.tasks.storage.progress import human_bytes

    return human_bytes(n)


def _line(node: str, r: Result) -> str:
    text = f"e31 prefetch on {node}: {r.job} ({r.run_id[:8]}): {r.outcome}"
    if r.outcome == "copied":
        text += f", {_size(r.copied_bytes)} in {r.seconds:.1f} s"
    text += f" ({r.detail})" if r.detail else ""
    return text + (f"; evicted to make room: {', '.join(r.evicted)}" if r.evicted else "")


def lowest_priority() -> None:
    """This process at the lowest CPU priority (nice 19) and, where Linux
    allows, the idle I/O class; it is killed when its parent (the worker)
    dies.  Best effort."""
    try:
        os.nice(19)
    except OSError:
        pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the worker
        number = {"x86_64": 251, "aarch64": 30}.get(platform.machine())  # ioprio_set (linux/ioprio.h)
        if number is not None:
            libc.syscall(number, 1, 0, 3 << 13)  # IOPRIO_WHO_PROCESS, this process, IOPRIO_CLASS_IDLE
    except Exception:
        pass


def serve(pool: Any, node: str, budget: int, root: Path, rate: float | None = None,
          every_s: float = PREFETCH_EVERY_S) -> None:
    """Prefetch passes until killed (see the module docstring)."""
    from prefect.client.orchestration import get_client

    prefetcher = Prefetcher(pool, node, budget, root, rate)
    parent = os.getppid()
    while True:
        try:
            with get_client(sync_client=True) as client:
                prefetcher.pass_once(client)
        except Exception as exc:  # the API is busy or away: the next pass tries again
            print(f"e31 prefetch on {node}: pass failed ({type(exc).__name__}: {_why(exc)})", flush=True)
        if os.getppid() != parent:  # the worker is gone
            return
        time.sleep(every_s)


def prefetch_rate() -> float | None:
    """``E31_PREFETCH_RATE``: the most bytes per second a prefetch copies
    (a size such as ``50MiB``, per second; unset: no cap).  Raises
    :class:`e31.errors.InvalidInput` naming the variable for a bad value."""
    from e31.errors import InvalidInput
    from e31.specs.units import parse_memory

    text = os.environ.get("E31_PREFETCH_RATE", "").strip()
    if not text:
        return None
    try:
        rate = parse_memory(text)
    except ValueError:
        rate = 0
    if rate <= 0:
        raise InvalidInput(f"E31_PREFETCH_RATE={text!r}: must be bytes per second, e.g. 50MiB (or unset: no cap)")
    return float(rate)


def main(argv: list[str] | None = None) -> int:
    """``python -m e31.deployments.prefetch --pool POOL --node NAME`` (started by ``e31 worker``)."""
    from e31.flows.compile import default_scratch_root
    from e31.specs.pool import load_pool
    from e31.tasks.storage.masking import install_log_masking

    parser = argparse.ArgumentParser(prog="e31-prefetch")
    parser.add_argument("--pool", required=True)
    parser.add_argument("--node", required=True)
    args = parser.parse_args(argv)
    install_log_masking()
    lowest_priority()
    pool = load_pool(args.pool)
    line = next(line for name, line in pool.node_lines() if name == args.node)
    try:
        serve(pool, args.node, int(line.scratch_budget or 0), default_scratch_root(), prefetch_rate())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
