"""The ``e31`` worker's ``kill_infrastructure`` (Prefect's documented hook,
e31.deployments.killinfra) with real processes and signals (not reaped
until the end: a zombie counts as ended, as the worker's own wait reaps it): a flow process
returning its output is waited for and never signalled; any other gets
SIGTERM, then SIGKILL after the grace period; a run still ``Cancelling``
and a process the worker did not start are left alone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import pytest

#: A stand-in flow process: writes "ready", then on SIGTERM writes its marker file and exits 0 (or ignores
#: SIGTERM with "ignore"); ends when its standard input closes.
CHILD = r"""
import signal, sys
marker, mode = sys.argv[1], sys.argv[2]
def term(*_):
    open(marker, "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else term)
print("ready", flush=True)
sys.stdin.read()
"""


def _child(tmp_path, mode: str = "stop") -> tuple[subprocess.Popen, object]:
    marker = tmp_path / f"marker-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc, marker


def _run(tags: list[str], state: str):
    from prefect.client.schemas.objects import FlowRun

    run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="r", tags=tags, run_count=1)

    async def read(run_id: str):
        assert run_id == str(run.id)
        return state, run

    return run, read


def test_a_flow_process_returning_its_output_is_waited_for_and_never_signalled(tmp_path):
    from e31.deployments.killinfra import kill_flow_process
    from e31.tasks.supervisor.marks import WORK_ENDED

    proc, marker = _child(tmp_path)
    run, read = _run([f"{WORK_ENDED}1:2026-12-04T18:00:00Z"], "CANCELLED")
    said: list[str] = []

    async def main():
        task = asyncio.ensure_future(kill_flow_process(str(proc.pid), {proc.pid: str(run.id)}, read, 0.2, said.append))
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:  # it has looked at the run and chose to wait
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # five grace periods: a kill would have come by now
        assert not task.done() and proc.poll() is None
        proc.stdin.close()  # the return ends
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(main()) == "waited"
    assert not marker.exists()
    assert proc.wait(10) == 0
    assert said == [f"flow process {proc.pid} is returning the run's output (its work ended before the cancel): "
                    "waited for, not killed"]


def test_any_other_flow_process_gets_sigterm_then_sigkill_after_the_grace_period(tmp_path):
    from e31.deployments.killinfra import kill_flow_process

    stops, stops_marker = _child(tmp_path)
    stubborn, stubborn_marker = _child(tmp_path, "ignore")
    run, read = _run([], "CANCELLED")
    flows = {stops.pid: str(run.id), stubborn.pid: str(run.id)}
    assert asyncio.run(kill_flow_process(str(stops.pid), flows, read, 30, print)) == "ended"
    assert stops_marker.read_text() == "SIGTERM"
    started = time.monotonic()
    assert asyncio.run(kill_flow_process(str(stubborn.pid), flows, read, 1.0, print)) == "killed"
    assert time.monotonic() - started >= 1.0
    assert stubborn.wait(10) == -9
    assert not stubborn_marker.exists()


def test_a_run_still_cancelling_or_a_process_not_its_own_is_left_alone(tmp_path):
    from prefect.exceptions import InfrastructureNotAvailable, InfrastructureNotFound

    from e31.deployments.killinfra import kill_flow_process

    proc, marker = _child(tmp_path)
    run, read = _run([], "CANCELLING")
    with pytest.raises(InfrastructureNotAvailable, match=f"flow process {proc.pid} is being cancelled by the "
                                                         "worker's runner"):
        asyncio.run(kill_flow_process(str(proc.pid), {proc.pid: str(run.id)}, read, 0.1, print))
    with pytest.raises(InfrastructureNotAvailable, match=f"process {proc.pid} is not a flow process this e31 "
                                                         "worker started"):
        asyncio.run(kill_flow_process(str(proc.pid), {}, read, 0.1, print))
    assert proc.poll() is None and not marker.exists()
    proc.stdin.close()
    assert proc.wait(10) == 0
    with pytest.raises(InfrastructureNotFound, match=f"flow process {proc.pid} has ended"):
        asyncio.run(kill_flow_process(str(proc.pid), {proc.pid: str(run.id)}, read, 0.1, print))


def test_the_e31_worker_implements_the_hook_so_prefect_sends_it_the_cancelling_timeout_teardown():
    from prefect.client.schemas.worker_channel import CANCELLING_TIMEOUT_TEARDOWN
    from prefect.workers.base import BaseWorker

    from e31.deployments.worker import E31Worker

    assert E31Worker.kill_infrastructure is not BaseWorker.kill_infrastructure
    worker = E31Worker(work_pool_name="e31-killinfra-test", node="n1")
    assert worker.cleanup_handler_registry.get(CANCELLING_TIMEOUT_TEARDOWN) is not None
