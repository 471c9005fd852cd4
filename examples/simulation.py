"""The simulation example work: a parameter sweep of the SIR epidemic model.

    dS/dt = -beta S I,   dI/dt = beta S I - gamma I,   dR/dt = gamma I

(S, I, R fractions of the population), integrated with
``scipy.integrate.solve_ivp`` at every point of a beta x gamma grid.

Entry point ``e31.examples.simulation:sweep`` (see
``specs/examples/sir-sweep.yaml``).  Data: ``grid``, a JSON file::

    {"beta":  {"start": 0.05, "stop": 1.0, "num": 20},    # np.linspace, per day
     "gamma": {"start": 0.03, "stop": 0.45, "num": 15},   # (or a list of values)
     "initial": {"S": 0.999, "I": 0.001, "R": 0.0},
     "t_span": [0, 365],                                   # days
     "method": "DOP853", "rtol": 1e-9, "atol": 1e-12}

Params (all optional): ``item_sleep`` (seconds slept per grid point, to
stand in for a costlier model in tests of early stops; 0).

Writes ``points/beta=B_gamma=G.json`` per point (B and G with 3 decimals:
``beta``, ``gamma``, ``R0`` = beta/gamma, ``peak_infected``, ``peak_time``
(days; found as the event ``beta S = gamma``, or 0 when I only falls),
``final_susceptible``, ``final_infected`` and ``final_recovered`` at the end
of ``t_span``, ``nfev``), and once every point is done ``summary.csv`` (one
line per point, beta-major order), ``summary.png`` (heatmaps of the peak
infected fraction and the final recovered fraction over the grid) and
``report.json``: ``complete``, ``total``, ``done``, ``attempts`` (per
attempt: ``skipped`` points already done and ``computed`` by it),
``seconds`` spent integrating in this attempt, the grid and the point of
the highest peak.

The finished points' results are checkpointed as the spec's policy asks
(``ctx.checkpoint_due``) with step = points done (``{"done": [names],
"results": {name: result}, "attempts": [...]}``); a resumed attempt starts
with an empty output folder (only the checkpoint carries over), writes the
checkpointed points' files back from their results and skips them.  On
``ctx.should_stop`` it checkpoints, writes ``report.json`` with
``"complete": false`` and returns with the finished points.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path

import numpy as np
from scipy.integrate import solve_ivp

POINTS = "points"
REPORT = "report.json"
SUMMARY_CSV = "summary.csv"
SUMMARY_PNG = "summary.png"
COLUMNS = ["beta", "gamma", "R0", "peak_infected", "peak_time", "final_susceptible", "final_infected",
           "final_recovered"]


def axis(spec) -> list[float]:
    """Grid values of one parameter: a list, or ``{"start", "stop", "num"}``
    (``np.linspace``), rounded to 9 decimals."""
    if isinstance(spec, dict):
        values = np.linspace(float(spec["start"]), float(spec["stop"]), int(spec["num"]))
    else:
        values = np.asarray(spec, dtype=float)
    return [round(float(v), 9) for v in values]


def point_name(beta: float, gamma: float) -> str:
    """The file name of a grid point's result."""
    return f"beta={beta:.3f}_gamma={gamma:.3f}.json"


def simulate(beta: float, gamma: float, grid: dict) -> dict:
    """Integrate one SIR run; returns the point's result record."""
    y0 = [float(grid["initial"][k]) for k in ("S", "I", "R")]
    t0, t1 = (float(t) for t in grid["t_span"])

    def rhs(t, y):
        s, i, _ = y
        return [-beta * s * i, beta * s * i - gamma * i, gamma * i]

    def peak(t, y):  # dI/dt = I (beta S - gamma) changes sign from + to - at the peak of I
        return beta * y[0] - gamma

    peak.direction = -1
    sol = solve_ivp(rhs, (t0, t1), y0, method=grid.get("method", "DOP853"), events=peak,
                    rtol=float(grid.get("rtol", 1e-9)), atol=float(grid.get("atol", 1e-12)))
    if not sol.success:
        raise RuntimeError(f"beta={beta} gamma={gamma}: solve_ivp failed: {sol.message}")
    if len(sol.t_events[0]):
        peak_time, peak_infected = float(sol.t_events[0][0]), float(sol.y_events[0][0][1])
    else:  # beta S0 <= gamma: I falls from the start
        peak_time, peak_infected = t0, y0[1]
    s_end, i_end, r_end = (float(v) for v in sol.y[:, -1])
    return {
        "beta": beta, "gamma": gamma, "R0": beta / gamma,
        "peak_infected": peak_infected, "peak_time": peak_time,
        "final_susceptible": s_end, "final_infected": i_end, "final_recovered": r_end,
        "nfev": int(sol.nfev),
    }


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def plot_summary(betas: list[float], gammas: list[float], results: list[dict]) -> bytes:
    """PNG bytes of two heatmaps over the grid (beta across, gamma up):
    the peak infected fraction and the final recovered fraction."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    index = {(r["beta"], r["gamma"]): r for r in results}
    fig = Figure(figsize=(10, 4.2), dpi=100)
    for k, (key, title) in enumerate([("peak_infected", "peak infected fraction"),
                                      ("final_recovered", "final recovered fraction")]):
        ax = fig.add_subplot(1, 2, k + 1)
        values = np.array([[index[(b, g)][key] for b in betas] for g in gammas])
        im = ax.pcolormesh(betas, gammas, values, shading="nearest", cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xlabel("beta (per day)")
        ax.set_ylabel("gamma (per day)")
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"SIR sweep: {len(betas)} x {len(gammas)} points")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def sweep(ctx) -> dict:
    """Run the sweep; see the module docstring.  Returns the report
    (``complete`` false when stopped early)."""
    p = {"item_sleep": 0.0}
    p.update(ctx.params)
    grid = json.loads(Path(ctx.data["grid"]).read_text())
    betas, gammas = axis(grid["beta"]), axis(grid["gamma"])
    points = [(b, g) for b in betas for g in gammas]
    names = [point_name(b, g) for b, g in points]
    if len(set(names)) != len(names):
        raise ValueError("grid points closer than 0.001 share a file name")
    if min(gammas) <= 0:
        raise ValueError("gamma must be > 0")
    folder = ctx.output_dir / POINTS

    done: set[str] = set()
    attempts: list[dict] = []
    results: dict[str, dict] = {}  # the finished points' results, kept in the checkpoint
    restored = ctx.restore()
    if restored is not None:
        state, _ = restored
        results = {n: dict(r) for n, r in state.get("results", {}).items() if n in names}
        for name, result in results.items():
            _write(folder / name, json.dumps(result, indent=1).encode())
        done = set(results)
        attempts = [dict(a) for a in state["attempts"]]
    attempt = {"attempt": len(attempts) + 1, "skipped": len(done), "computed": 0}
    attempts.append(attempt)
    last_step = len(done)
    ctx.progress(len(done), len(points))

    def save_checkpoint() -> None:
        nonlocal last_step
        if len(done) != last_step:
            ctx.checkpoint({"done": sorted(done), "results": results, "attempts": attempts}, step=len(done))
            last_step = len(done)

    seconds = 0.0
    for (beta, gamma), name in zip(points, names):
        if name in done:
            continue
        if ctx.should_stop:
            break
        started = time.perf_counter()
        result = simulate(beta, gamma, grid)
        seconds += time.perf_counter() - started
        if p["item_sleep"]:
            time.sleep(float(p["item_sleep"]))
        _write(folder / name, json.dumps(result, indent=1).encode())
        results[name] = result
        done.add(name)
        attempt["computed"] += 1
        ctx.progress(len(done), len(points))
        if ctx.checkpoint_due(len(done)) or len(done) == len(points):
            save_checkpoint()

    report = {"complete": len(done) == len(points), "total": len(points), "done": len(done),
              "attempts": attempts, "seconds": round(seconds, 4),
              "grid": {"beta": betas, "gamma": gammas, "initial": grid["initial"], "t_span": grid["t_span"]}}
    if not report["complete"]:
        save_checkpoint()
        _write(ctx.output_dir / REPORT, json.dumps(report, indent=2).encode())
        return report

    results = [json.loads((folder / n).read_text()) for n in names]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in results:
        writer.writerow([repr(float(r[c])) for c in COLUMNS])
    _write(ctx.output_dir / SUMMARY_CSV, buf.getvalue().encode())
    _write(ctx.output_dir / SUMMARY_PNG, plot_summary(betas, gammas, results))
    top = max(results, key=lambda r: r["peak_infected"])
    report["highest_peak"] = {k: top[k] for k in ("beta", "gamma", "peak_infected", "peak_time")}
    _write(ctx.output_dir / REPORT, json.dumps(report, indent=2).encode())
    return report
