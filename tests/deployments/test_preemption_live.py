"""Preemption in the live queue, against a real ``prefect server start``, ``e31 scheduler`` and
``e31 worker`` (its node told it has 1 GPU with E31_NODE_GPUS: this machine has none): a deadline job
arriving on a full node preempts a preemptible job, which returns its output marked ``partial``
(reason ``preempted``), goes back to the queue as the same flow run with none of its retries used,
and resumes from the checkpoint it returned."""

from __future__ import annotations

import json
import textwrap
from datetime import datetime, timedelta, timezone

import pytest

from tests.conftest import final_manifest
from tests.deployments.test_queue import queue, wait_for

pytestmark = pytest.mark.server

#: A work of N steps of 0.5 s, a checkpoint after each, that resumes from the one it is given; SIGTERM
#: (the stop warning) makes it note when it stopped and exit 0.  Each attempt is a line of attempts.txt;
#: the last attempt writes record.json.
STEPS = textwrap.dedent("""
    import json, os, pathlib, signal, sys, time
    out, ck = pathlib.Path(os.environ["E31_OUTPUT_DIR"]), pathlib.Path(os.environ["E31_CHECKPOINT_DIR"])
    resume = os.environ.get("E31_RESUME_DIR") or ""
    start = int(pathlib.Path(resume, "step").read_text()) if resume else 0
    log = pathlib.Path(sys.argv[2])
    with log.open("a") as f:
        f.write(json.dumps({"from": start, "start": time.time()}) + "\\n")

    def stopped(signum, frame):
        with log.open("a") as f:
            f.write(json.dumps({"stopped": time.time()}) + "\\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    total = 0
    for step in range(start + 1, int(sys.argv[1]) + 1):
        time.sleep(0.5)
        folder = ck / f"step-{step}"
        folder.mkdir()
        (folder / "step").write_text(str(step))
        (folder / "COMMITTED").write_text("")
    (out / "record.json").write_text(json.dumps({"resumed_from": start, "steps": int(sys.argv[1])}))
""")


def _pool(q, min_run: str) -> None:
    pool = json.loads(q.pool.read_text())
    pool["preemption"] = {"min_run": min_run}
    q.pool.write_text(json.dumps(pool))


def _history(run_id: str) -> list[tuple[str, str, str]]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [(s.timestamp.timestamp(), s.type.value, s.name, s.message or "")
                for s in client.read_flow_run_states(run_id)]


def _final(run_id: str) -> bool:
    """Whether the flow run's state is final (its manifest is written a moment before)."""
    return _history(run_id)[-1][1] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def _run_id(submitted: str) -> str:
    return next(w for w in submitted.split() if len(w) == 36 and w.count("-") == 4)


def test_a_deadline_job_preempts_a_preemptible_one_which_resumes_where_it_stopped(prefect_api, tmp_path):
    """...not before the victim has run the pool's min_run (12 s), which the deadline job's reason
    tells while it waits."""
    with queue(tmp_path, {"n1": 1}) as q:
        _pool(q, "12s")
        (q.root / "steps.py").write_text(STEPS)
        log = q.root / "trainer-attempts.jsonl"
        q.scheduler()
        q.worker("n1", 1)
        trainer = q.job("trainer", 1, 40, work="steps.py", preemptible=True, retries=0)
        spec = json.loads(trainer.read_text())
        spec["work"]["command"].append(str(log))
        spec["request"]["duration"] = "60s"  # the plan has the node busy for a minute: the deadline is at risk
        trainer.write_text(json.dumps(spec))
        victim = _run_id(q.submit(trainer))
        durable = q.root / "out" / "trainer" / "checkpoints"
        wait_for(lambda: any(durable.glob("step-*/COMMITTED")) and len(list(durable.glob("step-*"))) >= 1
                 and log.exists(), what="the trainer's first durable checkpoint")
        deadline = datetime.now(timezone.utc) + timedelta(seconds=75)
        urgent = q.job("urgent", 1, 2, deadline=deadline.isoformat())
        urgent_id = _run_id(q.submit(urgent))
        wait_for(lambda: final_manifest(q.root / "out" / "urgent") is not None, timeout=120, what="the urgent job")
        waited = [message for _, _, name, message in _history(urgent_id) if name == "Queued"]
        wait_for(lambda: final_manifest(q.root / "out" / "trainer") is not None, timeout=180,
                 what="the trainer's completion")
        wait_for(lambda: _final(victim), what="the trainer's final state")
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        history = _history(victim)
        urgent_record, trainer_record = q.record("urgent"), q.record("trainer")
        manifest = final_manifest(q.root / "out" / "trainer")
    attempts = [line for line in lines if "from" in line]
    stops = [line for line in lines if "stopped" in line]
    names = [name for _, _, name, _ in history]
    assert len(attempts) == 2 and len(stops) == 1, lines
    # the urgent work started only once the trainer's work had stopped (one device, never two works on it)
    assert stops[0]["stopped"] <= urgent_record["start"], (stops, urgent_record)
    assert urgent_record["end"] <= deadline.timestamp()
    # from the decision to the urgent job's work: the victim's stop (it stops at once), its return, the start
    decided = next(at for at, _, name, _ in history if name == "Preempting")
    began = next(at for at, kind, _, _ in history if kind == "RUNNING")
    assert decided - began >= 12.0, history  # never before the pool's min_run
    told = [m for m in waited if "once it has run the pool's min_run (12s)" in m]
    assert told and told[0].split("; ")[-1].startswith(f"preempts trainer ({victim[:8]}) at "), waited
    assert urgent_record["start"] - decided < 20, (decided, urgent_record)
    # the same flow run: Preempting, Preempted (its output returned), queued again, placed, completed
    for name in ("Preempting", "Preempted", "Queued", "Placed", "Completed"):
        assert name in names, history
    assert names.count("Preempting") == 1, history  # the ticks after the decision did not preempt again
    assert names.index("Preempting") < names.index("Preempted") < len(names) - 1 - names[::-1].index("Queued")
    preempted = next(message for _, _, name, message in history if name == "Preempted")
    assert preempted.startswith("preempted by urgent (") and "its deadline" in preempted, preempted
    returned = int(preempted.rsplit("returned step ", 1)[1].split()[0])
    # it resumed from the checkpoint its preemption returned, and its retries (0) were not used
    assert attempts[1]["from"] == returned == trainer_record["resumed_from"] >= 1
    assert manifest["status"] == "completed"
    # the manifest counts the preemption and the work it threw away: less than a step (0.5 s) and its upload
    assert manifest["preemptions"] == 1 and 0.0 <= manifest["lost_s"] < 3.0, manifest
    requeued = next(message for _, _, name, message in history if name == "Queued" and "preempted by" in message)
    assert requeued.endswith("queued again, resumes from there"), requeued
    # the reasons written while it waits after that keep the preemption's words
    after = names.index("Preempted") + 2
    clause = requeued.split("Queued: ", 1)[1].split("; returned step", 1)[0].split("; queued again", 1)[0]
    later = [m for _, _, name, m in history[after:names.index("Placed", after)] if name == "Queued"]
    assert all(m.endswith(f"; earlier: {clause}") for m in later), (clause, later)


def _trainer(q, log, steps: int = 40):
    """The preemptible job: ``steps`` steps of 0.5 s, planned to hold its node for a minute."""
    (q.root / "steps.py").write_text(STEPS)
    trainer = q.job("trainer", 1, steps, work="steps.py", preemptible=True, retries=0)
    spec = json.loads(trainer.read_text())
    spec["work"]["command"].append(str(log))
    spec["request"]["duration"] = "60s"
    trainer.write_text(json.dumps(spec))
    return trainer


def _urgent(q, seconds: float = 2, within: float = 75):
    return q.job("urgent", 1, seconds, deadline=(datetime.now(timezone.utc) + timedelta(seconds=within)).isoformat())


def _preempted_held_in_its_return(q, log) -> tuple[str, int]:
    """A queue whose worker holds a flow process stopped once its return has begun (tests/hold): the
    trainer runs to its first durable checkpoint, an urgent job preempts it, and its flow process stops
    in the return of its output.  Returns the trainer's run id and that flow process's pid."""
    from e31.flows.joblock import lock_holder
    from tests import hold

    _pool(q, "2s")
    q.scheduler()
    q.worker("n1", 1, env=hold.env("returning", q.root / "held"))
    victim = _run_id(q.submit(_trainer(q, log)))
    durable = q.root / "out" / "trainer" / "checkpoints"
    wait_for(lambda: any(durable.glob("step-*/COMMITTED")), what="the trainer's first durable checkpoint")
    q.submit(_urgent(q))
    return victim, hold.wait_stopped(lambda: lock_holder(str(q.root / "scratch-n1" / "trainer"))[0])


def test_a_preempted_job_killed_during_its_return_is_still_returned_whole_and_queued_again(prefect_api, tmp_path):
    """kill -9 of the victim's flow process in the middle of its preemption's return: its worker
    finishes the return (every file and the partial manifest at the destination agree), the run ends
    ``Preempted`` (not ``Cancelled``: it is not lost), is queued again and completes; the urgent job's
    work starts only once that return is finished."""
    import os
    import signal

    with queue(tmp_path, {"n1": 1}) as q:
        log = q.root / "trainer-attempts.jsonl"
        victim, flow_pid = _preempted_held_in_its_return(q, log)
        returning = json.loads((q.root / "out" / "trainer" / "partial" / "manifest.json").read_text())
        os.kill(flow_pid, signal.SIGKILL)
        wait_for(lambda: final_manifest(q.root / "out" / "urgent") is not None, timeout=120, what="the urgent job")
        wait_for(lambda: final_manifest(q.root / "out" / "trainer") is not None, timeout=180,
                 what="the trainer's completion")
        wait_for(lambda: _final(victim), what="the trainer's final state")
        history = _history(victim)
        urgent_record = q.record("urgent")
        lines = [json.loads(line) for line in log.read_text().splitlines()]
    names = [name for _, _, name, _ in history]
    assert returning["status"] == "returning"
    assert "Preempting" in names and "Preempted" in names and names[-1] == "Completed", history
    assert "Cancelled" not in names, history
    preempted_at = next(at for at, _, name, _ in history if name == "Preempted")
    assert urgent_record["start"] >= preempted_at - 1.0, (urgent_record, preempted_at)  # after the return ended
    attempts = [line for line in lines if "from" in line]
    assert len(attempts) == 2 and attempts[1]["from"] >= 1, lines


def test_a_preempted_job_cancelled_while_it_waits_to_run_again_never_runs_again(prefect_api, tmp_path):
    import subprocess

    with queue(tmp_path, {"n1": 1}) as q:
        _pool(q, "2s")
        log = q.root / "trainer-attempts.jsonl"
        q.scheduler()
        q.worker("n1", 1)
        victim = _run_id(q.submit(_trainer(q, log)))
        durable = q.root / "out" / "trainer" / "checkpoints"
        wait_for(lambda: any(durable.glob("step-*/COMMITTED")), what="the trainer's first durable checkpoint")
        q.submit(_urgent(q, seconds=15))
        wait_for(lambda: any(name == "Queued" and "preempted by" in message
                             for _, _, name, message in _history(victim)), what="the trainer queued again")
        done = subprocess.run([q.exe, "cancel", victim, "--pool", str(q.pool)], capture_output=True, text=True,
                              cwd=q.root)
        assert done.returncode == 0, done.stderr
        wait_for(lambda: final_manifest(q.root / "out" / "urgent") is not None, timeout=120, what="the urgent job")
        history = _history(victim)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        partial = final_manifest(q.root / "out" / "trainer" / "partial")
    assert history[-1][1:3] == ("CANCELLED", "Cancelled"), history
    assert len([line for line in lines if "from" in line]) == 1, lines  # it never ran again
    assert (partial["status"], partial["reason"], partial["preemptions"]) == ("partial", "preempted", 1)


def test_a_job_preempted_while_it_stages_its_inputs_never_starts_that_work_and_runs_later(prefect_api, tmp_path):
    """The victim's staging (a download served at 64 KiB/s the first time) is stopped by the preemption:
    its work never starts on that attempt, its manifest says ``preempted`` with no work lost, and it
    runs once the urgent job is done."""
    import time

    from tests.slowhttp import slow_server

    server, gets = slow_server(slow_gets=1)
    try:
        with queue(tmp_path, {"n1": 1}) as q:
            _pool(q, "1s")
            log = q.root / "trainer-attempts.jsonl"
            q.scheduler()
            q.worker("n1", 1)
            trainer = _trainer(q, log, steps=4)
            spec = json.loads(trainer.read_text())
            spec["data"] = [{"name": "inp", "url": f"http://127.0.0.1:{server.server_address[1]}/inputs.bin"}]
            trainer.write_text(json.dumps(spec))
            victim = _run_id(q.submit(trainer))
            wait_for(lambda: len(gets) == 1, what="the trainer's download to start")
            time.sleep(1.5)  # past the pool's min_run of 1 s, still downloading (30 s)
            q.submit(_urgent(q))
            wait_for(lambda: final_manifest(q.root / "out" / "urgent") is not None, timeout=120, what="the urgent job")
            wait_for(lambda: final_manifest(q.root / "out" / "trainer") is not None, timeout=180,
                     what="the trainer's completion")
            wait_for(lambda: _final(victim), what="the trainer's final state")
            history = _history(victim)
            lines = [json.loads(line) for line in log.read_text().splitlines()]
            urgent_record = q.record("urgent")
            manifest = final_manifest(q.root / "out" / "trainer")
    finally:
        server.shutdown()
    names = [name for _, _, name, _ in history]
    assert names.count("Preempting") == 1 and names[-1] == "Completed", history
    preempted = next(message for _, _, name, message in history if name == "Preempted")
    assert preempted.endswith("returned no checkpoint (partial)"), preempted
    assert [line["from"] for line in lines if "from" in line] == [0], lines  # the first attempt's work never ran
    assert urgent_record["start"] < lines[0]["start"]
    assert (manifest["preemptions"], manifest["lost_s"]) == (1, 0.0), manifest



def test_a_job_cancelled_while_it_is_being_preempted_ends_cancelled_and_never_runs_again(prefect_api, tmp_path):
    """``e31 cancel`` of the victim while its flow process returns its output for the preemption (held
    there, stopped): its return finishes, the run ends ``Cancelled`` (not queued again), and its partial
    output says ``preempted``."""
    import os
    import signal
    import subprocess

    with queue(tmp_path, {"n1": 1}) as q:
        log = q.root / "trainer-attempts.jsonl"
        victim, flow_pid = _preempted_held_in_its_return(q, log)
        done = subprocess.run([q.exe, "cancel", victim, "--pool", str(q.pool)], capture_output=True, text=True,
                              cwd=q.root)
        os.kill(flow_pid, signal.SIGCONT)
        wait_for(lambda: final_manifest(q.root / "out" / "urgent") is not None, timeout=120, what="the urgent job")
        wait_for(lambda: _history(victim)[-1][2] == "Cancelled", what="the trainer cancelled")
        history = _history(victim)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        partial = final_manifest(q.root / "out" / "trainer" / "partial")
    assert done.returncode == 0 and "it is being preempted" in done.stdout, (done.stdout, done.stderr)
    names = [name for _, _, name, _ in history]
    assert names[-1] == "Cancelled" and "Preempted" in names and "Queued" not in names[names.index("Preempted"):], \
        history
    assert history[-1][3].startswith("cancelled while it was being preempted (cancel requested (e31 cancel)); "
                                     "preempted by urgent ("), history
    assert len([line for line in lines if "from" in line]) == 1, lines  # it never ran again
    assert (partial["status"], partial["reason"], partial["preemptions"]) == ("partial", "preempted", 1)
