"""Issue 36 item 5 (first part): ``e31 simulate`` models preemption, worked by hand.

One node of 8 GPUs (``--as gpus``).  Job 1 (submitted at 0, 8 GPUs, requested time -1: no duration
declared, limit ``--default-limit 5h``) really runs 10,000 s; job 2 (submitted at 3,600, 8 GPUs,
asks 600 s and runs 600 s) is the trace's first line, so ``--deadlines 2 --deadline-every 2`` gives it
alone a deadline: 3,600 + 2 x 600 = 4,800.

Without ``--checkpoint-every`` nothing is preempted: job 2 could start only when job 1 ends (10,000),
too late for its deadline, so the planner refuses it.  With ``--checkpoint-every 25m --restart-cost 1m`` job 1 (no deadline, so
preemptible) has run 3,600 s (past the pool's 10-minute minimum run) when job 2 arrives, and keeps
the 3,000 s up to its second checkpoint; it loses 600 s x 8 GPUs = 4,800 GPU-seconds (1.3333 GPU-hours).
Job 2 runs 3,600-4,200 and meets its deadline; job 1 starts again at 4,200, spends 60 s restarting,
and does its remaining 7,000 s: it ends at 11,260.  Mean completion (11,260 + 600) / 2 = 5,930 s.
"""

from __future__ import annotations

import json

import pytest

TRACE = """; UnixStartTime: 1767225600
 2  3600  -1    600  8  -1  -1  8   600  -1  1  7  1  1  1  1  -1  -1
 1     0  -1  10000  8  -1  -1  8    -1  -1  1  9  1  1  1  1  -1  -1
"""
POOL = "pool_version: 1\nname: eight\nnodes: [{name: g, gpus: 8, cpus: 64, memory: 512GiB}]\n"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "t.swf").write_text(TRACE)
    (tmp_path / "pool.yaml").write_text(POOL)
    return str(tmp_path / "t.swf"), str(tmp_path / "pool.yaml")


def run(e31, files, *extra):
    trace, pool = files
    out = e31("simulate", trace, "--pool", pool, "--as", "gpus", "--json", "--deadlines", "2", "--deadline-every",
              "2", "--default-limit", "5h", *extra)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    result.pop("planning_s")
    assert result.pop("resource") == "gpus"
    return result


def test_a_deadline_job_preempts_a_checkpointing_job_and_both_finish(e31, files):
    without = run(e31, files)
    assert (without["jobs"], without["refused"], without["deadlines_met"], without["preemptions"],
            without["mean_completion_s"]) == (1, 1, 0, 0, 10_000.0)
    with_ = run(e31, files, "--checkpoint-every", "25m", "--restart-cost", "1m")
    assert with_ == {
        "jobs": 2, "refused": 0, "makespan_s": 11_260.0, "avg_wait_s": 0.0, "max_wait_s": 0.0,
        "avg_bounded_slowdown": pytest.approx((11_260 / (3_600 + 7_060) + 1) / 2),
        "utilization": pytest.approx(8 * (3_600 + 600 + 7_060) / (8 * 11_260)),
        "deadlines_met": 1, "deadlines_total": 1, "deadlines_feasible": 1,
        "mean_completion_s": 5_930.0, "preemptions": 1, "lost_gpu_hours": pytest.approx(4_800 / 3600),
    }


def test_restart_cost_without_checkpoints_is_refused_with_the_fix(e31, files):
    trace, pool = files
    out = e31("simulate", trace, "--pool", pool, "--restart-cost", "1m")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("e31: --restart-cost is the cost of a preempted job's restart, and jobs are preempted only "
                          "with --checkpoint-every; add --checkpoint-every (e.g. 30m), or drop --restart-cost\n")
    out = e31("simulate", trace, "--pool", pool, "--checkpoint-every=-5m")
    assert out.returncode == 2 and "--checkpoint-every" in out.stderr and "use e.g. 30m" in out.stderr
    out = e31("simulate", trace, "--pool", pool, "--checkpoint-every", "0.5s")  # each checkpoint is an event
    assert (out.returncode, out.stderr.splitlines()[-1]) == (
        2, "e31 simulate: error: argument --checkpoint-every: must be at least 1 second (got '0.5s'); use e.g. 30m")
