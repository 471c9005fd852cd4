"""``e31 cancel``: cancel a queued or running job of a pool, whatever state its run is in (queued,
placed, running, being preempted, preempted, crashed), in one write where one is enough."""

from __future__ import annotations

import argparse
import sys
from datetime import timezone
from typing import Any

from e31.deployments.commands import _need_api, _pool, _server_clock
from e31.errors import EXIT_FAILED, EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.client.orchestration import get_client

    from e31.flows.queue import read
    from e31.states import PREEMPTING, cancelled, cancelling
    from e31.tasks.supervisor.marks import work_ended_at

    pool = _pool(args.pool)
    _need_api()
    with get_client(sync_client=True) as client:
        snap = read(client, pool)
        targets = [k for k in snap.runs if k == args.job or k.startswith(args.job) and len(args.job) >= 8
                   or (k in snap.specs and snap.specs[k].name == args.job)]
        if not targets:
            from e31.deployments.runwords import ended_line

            print(f"e31: cancel: no queued or running job {args.job!r} in pool {pool.name}: "
                  f"{ended_line(client, pool.name, args.job, snap.now)}", file=sys.stderr)
            return EXIT_FAILED
        late = 0
        for key in targets:
            # One write whatever the run's state is now (it may have started since it was read): the server
            # turns the Cancelling of a run still scheduled (queued or placed) into Cancelled itself, in the
            # same transaction ("no infrastructure to terminate"); a run that started gets Cancelling, which
            # its flow process answers by returning its output.  Choosing from the state read above let a run
            # that started in between be forced Cancelled while it ran on, to its end.
            # A crashed run waits to be requeued and runs nowhere (a requeue, placement and start in between
            # would take seconds): it is cancelled outright.
            name = snap.specs[key].name if key in snap.specs else (snap.runs[key].name or key)
            if snap.runs[key].state.type.value == "CANCELLED":  # preempted, its output returned: not queued again
                client.set_flow_run_state(key, cancelled(
                    "cancelled after a preemption, before it was queued again (e31 cancel)"), force=True)
                print(f"cancelled {name} ({key}): it had been preempted; it will not be queued again")
                continue
            if snap.runs[key].state.type.value == "CRASHED":
                client.set_flow_run_state(key, cancelled(
                    "cancelled after a crash, before it was queued again (e31 cancel)"), force=True)
                print(f"cancelled {name} ({key}): it had crashed; it will not be queued again")
                continue
            if snap.runs[key].state.name == PREEMPTING:
                _cancel_preempting(client, key)
                print(f"cancelling {name} ({key}): it is being preempted; what it has is returned, with its "
                      "manifest, and it will not be queued again")
                continue
            # A run whose work has ended (its flow process tags it so, before the return starts) is not
            # cancelled: its output comes back whole and the run ends as its manifest says.  Not forced, so
            # the server refuses (aborts) a cancel of a run that ended meanwhile, in the same transaction.
            ended = work_ended_at(snap.runs[key])
            result = None if ended else client.set_flow_run_state(
                key, cancelling("cancel requested (e31 cancel)"))
            if result is not None and result.status == SetStateStatus.ABORT:
                now = client.read_flow_run(key)
                print(f"e31: cancel: run {name} ({key}) had already ended {now.state.name if now.state else ''} "
                      f"at {_ended_at(now)}: nothing to cancel", file=sys.stderr)
                late += 1
                continue
            if ended is None and (result.state is None or result.state.type.value != "CANCELLED"):
                ended = work_ended_at(client.read_flow_run(key))  # its work ended as the cancel was written
            if ended is not None:
                print(f"e31: cancel: run {name} ({key}) had already finished its work (at {_utc(ended)}): "
                      f"nothing to cancel; its output is returned whole and the run ends as its manifest says",
                      file=sys.stderr)
                late += 1
            elif result.state is not None and result.state.type.value == "CANCELLED":
                client.set_flow_run_state(key, cancelled("cancelled while queued (e31 cancel)"),
                                          force=True)  # the reason in E31's words; Cancelled is final: no race
                print(f"cancelled {name} ({key}): removed from the queue")
            else:
                print(f"cancelling {name} ({key}): its work is stopped (or never starts, if it has "
                      "not yet) and what it has is returned, with its manifest")
    return EXIT_FAILED if late == len(targets) else EXIT_OK


def _cancel_preempting(client: Any, key: str) -> None:
    """Cancel the run ``key``, which the queue is preempting (``Cancelling`` named ``Preempting``): a plain
    ``Cancelling`` after the decision tells the scheduler not to queue it again once its output is returned
    (:func:`e31.flows.queue.preempt.requeue`).  Prefect's rules refuse a ``Cancelling`` over a
    ``Cancelling``, so it is forced; a run that ended ``Preempted`` just before that write is made
    ``Cancelled`` at once (a forced ``Cancelling`` of a run with no process would wait for the server's
    cleanup)."""
    from e31.states import cancelled, cancelling

    client.set_flow_run_state(key, cancelling("cancel requested (e31 cancel)"), force=True)
    states = sorted((s for s in client.read_flow_run_states(key) if s.timestamp is not None),
                    key=lambda s: s.timestamp)
    if len(states) >= 2 and states[-2].type.value == "CANCELLED":
        client.set_flow_run_state(key, cancelled(
            "cancelled after a preemption, before it was queued again (e31 cancel)"), force=True)


def _utc(stamp: str) -> str:
    """``2026-12-03T18:41:37Z`` as ``18:41:37 UTC`` (the day too when it is not today)."""
    day, _, rest = stamp.partition("T")
    today = _server_clock().strftime("%Y-%m-%d")  # the stamp is the server's
    return f"{rest.rstrip('Z')} UTC" + ("" if day == today else f" on {day}")


def _ended_at(run: Any) -> str:
    """When the flow run ``run`` ended, as :func:`_utc` writes it ("an unknown time" when its state has none)."""
    when = run.state.timestamp if run.state is not None else None
    return _utc(when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")) if when else "an unknown time"
