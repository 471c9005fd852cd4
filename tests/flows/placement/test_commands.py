"""``e31 pool``, ``e31 plan`` and ``e31 simulate`` through the installed console script.

The SWF trace ``data/small.swf`` (13 jobs on a 4-CPU node) worked by hand under
first come, first served (FCFS starts jobs only in arrival order, each at the
first event where it fits):

    job  submit  procs  run  start  end   wait  bounded slowdown
    1        0      2   100      0   100     0   1
    2       10      2    50     10    60     0   1
    3       20      4   300    100   400    80   380/300 = 1.2667
    4       30      1    20    400   420   370   390/20  = 19.5
    5       40      3    60    400   460   360   420/60  = 7
    6      500      1    40    500   540     0   1
    7      510      2    10    510   520     0   1
    8      520      4   200    540   740    20   220/200 = 1.1
    9      600      1     5    740   745   140   145/10  = 14.5
    10    1000      5         refused: no node holds 5 CPUs
    11    1100            skipped: unknown run time
    12    1200      2    30   1200  1230     0   1        (no requested time: the run time is the limit)
    13    1300      4    50   1300  1350     0   1        (ran 80 s but asked for 50: stopped at its limit)

11 jobs ran; makespan 1350 s; waits sum to 970 s (average 970/11, maximum 370 s);
slowdowns sum to 49.3667 (average 49.3667/11); busy CPU-seconds 2825 of 4 x 1350.

With ``--deadlines 2 --deadline-every 2`` jobs 1, 3, 5, 7, 9 and 12 must end by
submit + 2 x limit: job 5 (by 240) is dropped at 400 when it could no longer
make it, job 9 (by 620) at 740; job 4 then starts alone at 400.  4 of 6
deadlines are met, 9 jobs run (waits 470 s in all), 3 are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
TRACE, ONE_NODE = str(DATA / "small.swf"), str(DATA / "one-node.yaml")


def simulate_json(e31, *extra: str) -> dict:
    out = e31("simulate", TRACE, "--pool", ONE_NODE, "--json", *extra)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result.pop("planning_s") >= 0
    assert result.pop("resource") == "cpus"  # a CPU trace: its *_hours are CPU-hours
    return result


def test_simulate_fcfs_gives_the_numbers_worked_by_hand(e31):
    assert simulate_json(e31, "--policy", "fcfs") == {
        "jobs": 11, "refused": 1, "makespan_s": 1350.0,
        "avg_wait_s": pytest.approx(970 / 11), "max_wait_s": 370.0,
        "avg_bounded_slowdown": pytest.approx((6 + 380 / 300 + 19.5 + 7 + 1.1 + 14.5) / 11),
        "utilization": pytest.approx(2825 / (4 * 1350)),
        "deadlines_met": 0, "deadlines_total": 0, "deadlines_feasible": 0,
        "mean_completion_s": pytest.approx((970 + 865) / 11),  # the waits plus the 865 s the jobs ran
        "preemptions": 0, "lost_gpu_hours": 0.0,
    }
    assert simulate_json(e31, "--policy", "fcfs", "--deadlines", "2", "--deadline-every", "2") == {
        "jobs": 9, "refused": 3, "makespan_s": 1350.0,
        "avg_wait_s": pytest.approx(470 / 9), "max_wait_s": 370.0,
        "avg_bounded_slowdown": pytest.approx((6 + 380 / 300 + 19.5 + 1.1) / 9),
        "utilization": pytest.approx(2640 / (4 * 1350)),
        "deadlines_met": 4, "deadlines_total": 6, "deadlines_feasible": 6,
        "mean_completion_s": pytest.approx((470 + 800) / 9), "preemptions": 0, "lost_gpu_hours": 0.0,
    }


def test_simulate_prints_a_summary_and_backfills_under_e31(e31):
    out = e31("simulate", TRACE, "--pool", ONE_NODE, "--policy", "e31")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"trace {TRACE}: 12 jobs (1 skipped: unknown run time or processors); pool small (1 node); "
                        "policy e31")
    assert lines[1:9] == [
        "  jobs run                  11",
        "  refused                   1",
        "  makespan                  1350 s",
        "  average wait              35.5 s",
        "  maximum wait              140 s",
        "  average bounded slowdown  2.506 (threshold 10 s)",
        "  utilisation (CPUs)        52.3%",
        "  deadlines met             none assigned (--deadlines FACTOR)",
    ]
    assert lines[9:11] == ["  mean completion           114.1 s", "  preemptions               0 (0.00 CPU-hours lost)"]
    assert lines[11].startswith("  planning time") and len(lines) == 12
    assert simulate_json(e31, "--jobs", "3")["jobs"] == 3


@pytest.mark.parametrize(("args", "message"), [
    (["--jobs", "0"], "e31 simulate: error: argument --jobs: must be at least 1 (got 0)"),
    (["--deadlines", "0.5"], "e31 simulate: error: argument --deadlines: must be at least 1: a job cannot finish "
                             "before its limit allows (got 0.5)"),
    (["--as", "gpus"], "e31: --as gpus: pool small has no GPUs; use --as cpus or a pool with gpus"),
    (["--policy", "sjf"], "e31 simulate: error: argument --policy: invalid choice: 'sjf' (choose from 'e31', "
                          "'fcfs', 'easy', 'edf')"),
])
def test_simulate_refuses_bad_flags_in_one_line(e31, args, message):
    out = e31("simulate", TRACE, "--pool", ONE_NODE, *args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in out.stderr


def test_simulate_names_a_malformed_trace_line(e31, tmp_path):
    bad = tmp_path / "bad.swf"
    bad.write_text("; a header\n1 0 -1 10 1\n", encoding="utf-8")
    out = e31("simulate", str(bad), "--pool", ONE_NODE)
    assert (out.returncode, out.stderr.strip()) == (2, (
        f"e31: {bad}:2: expected 18 fields, got 5; an SWF job line has 18 whitespace-separated numbers, "
        "-1 for unknown (header lines start with ';')"))


POOL = "pool_version: 1\nname: lab\nnodes:\n  - {name: gpu, count: 2, gpus: 8, gpu_type: A100, cpus: 64, memory: 512GiB}\n"


def spec(tmp_path, name: str, request: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nwork: {{kind: training, command: [python, train.py]}}\nrequest: {request}\n"
                    f"output: {{kind: model, url: out/{name}/, files: [model.pt]}}\n", encoding="utf-8")
    return str(path)


def test_pool_prints_the_node_lines(e31, tmp_path):
    (tmp_path / "pool.yaml").write_text(POOL + "  - {name: big, cpus: 192, memory: 1.5TiB}\n", encoding="utf-8")
    out = e31("pool", str(tmp_path / "pool.yaml"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "pool lab: 3 nodes, 16 GPUs, 320 CPUs, 2.5 TiB memory",
        "NODES         COUNT  GPUS  GPU TYPE  CPUS   MEMORY",
        "gpu-1..gpu-2      2     8  A100        64  512 GiB",
        "big               1     0  -          192  1.5 TiB",
        "preemption: min_run 10m, attained_min_run 1h; no cap",
    ]
    here = e31("pool")
    assert here.returncode == 0 and "as a one-node pool: 1 node," in here.stdout.splitlines()[0]


def test_plan_prints_the_table_and_a_gantt_chart(e31, tmp_path):
    # all submitted now: equal expansion factors, so the shortest goes first
    (tmp_path / "pool.yaml").write_text(POOL, encoding="utf-8")
    specs = [spec(tmp_path, "train-a", "{gpus: 8, duration: 2h, limit: 3h}"),
             spec(tmp_path, "train-b", "{gpus: 8, duration: 1h, limit: 2h, deadline_within: 3h}"),
             spec(tmp_path, "small", "{gpus: 2, cpus: 4, memory: 16GiB, duration: 30m}"),
             spec(tmp_path, "huge", "{gpus: 9, limit: 1h}")]
    png = tmp_path / "plan.png"
    out = e31("plan", *specs, "--pool", str(tmp_path / "pool.yaml"), "--now", "2026-01-01T00:00:00Z",
              "--png", str(png))
    assert out.returncode == 1, out.stderr  # a job was refused
    lines = [line.rstrip() for line in out.stdout.splitlines()]
    header = lines[1]
    reason_at = header.index("REASON")
    assert lines[0] == "plan of 4 jobs on pool lab at 00:00 UTC (policy e31)"
    assert [line[:reason_at].split() for line in lines[1:6]] == [
        ["JOB", "ACTION", "NODE", "GPUS", "START", "END"],
        ["small", "start", "gpu-1", "0,1", "00:00", "UTC", "00:30", "UTC"],
        ["train-b", "start", "gpu-2", "0,1,2,3,4,5,6,7", "00:00", "UTC", "01:00", "UTC"],
        ["train-a", "wait", "gpu-1", "0,1,2,3,4,5,6,7", "00:30", "UTC", "02:30", "UTC"],
        ["huge", "refuse", "-", "-", "-", "-"],
    ]
    assert [line[reason_at:] for line in lines[2:6]] == [
        "starts now on gpu-1, GPUs 0,1, 4 CPUs, 16 GiB; expected end 00:30 UTC (run time 30m: duration)",
        "starts now on gpu-2, GPUs 0,1,2,3,4,5,6,7, 1 CPU; expected end 01:00 UTC (run time 1h: duration); "
        "ends 01:00 UTC, before its deadline 03:00 UTC",
        "waiting for 8 GPUs on one node (6 free on gpu-1); earliest start 00:30 UTC on gpu-1, after job small ends",
        "no node can hold 9 GPUs: the largest nodes have 8 GPUs: ask for at most 8 GPUs (request.gpus), or add a "
        "larger node to the pool file",
    ]
    assert lines[6] == f"Gantt chart: {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_takes_set_for_every_spec(e31, tmp_path):
    """``--set`` overrides a field of each SPEC, as for the commands that take one: the huge job split over
    two nodes fits."""
    (tmp_path / "pool.yaml").write_text(POOL, encoding="utf-8")
    huge = spec(tmp_path, "huge", "{gpus: 9, limit: 1h}")
    out = e31("plan", huge, "--pool", str(tmp_path / "pool.yaml"), "--now", "2026-01-01T00:00:00Z",
              "--set", "request.gpus=8", "--set", "request.nodes=2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[2].split()[:4] == ["huge", "start", "gpu-1+gpu-2", "0,1,2,3,4,5,6,7+0,1,2,3,4,5,6,7"]


def test_plan_reports_an_invalid_pool_with_every_problem(e31, tmp_path):
    (tmp_path / "pool.yaml").write_text("nodes: [{name: n, cpus: 0}]\n", encoding="utf-8")
    out = e31("plan", spec(tmp_path, "a", "{limit: 1h}"), "--pool", str(tmp_path / "pool.yaml"))
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"invalid pool {tmp_path / 'pool.yaml'} (2 problems)",
        "  nodes[0].cpus: must be >= 1 (got 0)",
        "  nodes[0].memory: required field is missing; add e.g. memory: 512GiB",
    ]


def test_deadline_every_without_deadlines_is_refused_in_one_line(e31):
    out = e31("simulate", TRACE, "--pool", ONE_NODE, "--deadline-every", "2")
    assert out.returncode == 2
    assert out.stderr == ("e31: --deadline-every gives deadlines to every K-th job only with --deadlines FACTOR; add "
                          "--deadlines (e.g. --deadlines 2), or drop --deadline-every\n")


def test_simulate_as_gpus_runs_a_job_wider_than_a_node_on_several_nodes_at_once(e31, tmp_path):
    trace = tmp_path / "gangs.swf"
    fields = "{id} {submit} -1 {run} {procs} -1 -1 {procs} {run} -1 1 1 -1 -1 -1 -1 -1 -1"
    trace.write_text("\n".join(fields.format(id=i, submit=s, run=r, procs=p) for i, s, r, p in (
        (1, 0, 100, 16),   # 2 nodes of 8 GPUs: 0-100
        (2, 10, 50, 4),    # waits for it: 100-150 on g-1
        (3, 20, 30, 12),   # 2 nodes of 6 GPUs: g-1 has 4 free until 150, so 150-180
        (4, 30, 10, 24),   # 3 nodes of 8: the pool has 2, refused
    )) + "\n", encoding="utf-8")
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: lab\nnodes:\n  - {name: g, count: 2, gpus: 8, cpus: 16, memory: 64GiB, "
                    "group: rack-1}\n", encoding="utf-8")
    out = e31("simulate", str(trace), "--pool", str(pool), "--as", "gpus", "--policy", "fcfs", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["jobs"], result["refused"], result["makespan_s"], result["max_wait_s"]) == (3, 1, 180.0, 130.0)
    assert result["resource"] == "gpus"
    assert result["utilization"] == pytest.approx((16 * 100 + 4 * 50 + 12 * 30) / (16 * 180))
    assert result["mean_completion_s"] == pytest.approx((100 + 140 + 160) / 3)
    out = e31("simulate", str(trace), "--pool", str(pool), "--as", "gpus", "--policy", "fcfs")
    assert out.stdout.splitlines()[0] == (f"trace {trace}: 4 jobs, 3 of them on several nodes (0 skipped: unknown "
                                          "run time or processors); pool lab (2 nodes); policy fcfs")
