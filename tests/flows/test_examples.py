"""The three example jobs beside the digits retrain -- bulk inference, image
processing, a simulation sweep -- end to end on the real Prefect engine with
their real data: a full run checked against values recomputed here, and an
early stop (time limit) whose partial output is only the finished items,
then a rerun that completes without redoing them."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage
from scipy.integrate import odeint
from scipy.optimize import brentq

from e31.examples.digits import build_model
from e31.flows.job import run_job
from e31.specs import load_spec
from e31.tasks.work.local_checkpoints import MARKER, STATE_FILE, load_state

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "specs" / "examples"
DATA = EXAMPLES / "data"
INFERENCE = EXAMPLES / "digits-inference.yaml"
PROCESSING = EXAMPLES / "image-processing.yaml"
SIMULATION = EXAMPLES / "sir-sweep.yaml"

DIGIT_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]  # labels 0..9 in the 1,797 rows
BACKLOG = ["astronaut", "brick", "camera", "cell", "chelsea", "coffee", "coins", "grass", "rocket", "text"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _returned(out: Path, manifest: dict) -> set[str]:
    """Check every file the manifest lists against its folder at the
    destination (the top, or partial/ for a run that did not complete:
    bytes, sha256) and that nothing else came back; returns the listed paths."""
    folder = out / manifest["folder"]
    listed = {f["path"] for f in manifest["files"]}
    for f in manifest["files"]:
        assert f["bytes"] == (folder / f["path"]).stat().st_size and f["sha256"] == _sha(folder / f["path"]), f["path"]
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {p for p in on_disk if p != "manifest.json" and not p.startswith(("checkpoints/", "partial/"))} == listed
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    return listed


def _checkpoint_state(out: Path, manifest: dict) -> dict:
    """The state of the manifest's checkpoint, which must be the newest durable one."""
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*") if (p / MARKER).is_file())
    assert steps and manifest["step"] == steps[-1]
    assert manifest["checkpoint"] == str(out / "checkpoints" / f"step-{steps[-1]}")
    return load_state(out / "checkpoints" / f"step-{steps[-1]}" / STATE_FILE)


def _stop_early(e31, spec: Path, out: Path, scratch: Path, limit: str, grace: str, item_sleep: float) -> dict:
    """``e31 run`` with a short time limit: exit 3, a partial manifest."""
    result = e31(
        "run", str(spec), "--set", f"output.url={out}", "--set", f"request.limit={limit}",
        "--set", "request.duration=1s", "--set", f"request.grace={grace}",
        "--set", f"work.params.item_sleep={item_sleep}", env={"E31_SCRATCH": str(scratch)},
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert manifest["status"] == "partial" and manifest["reason"] == "time_limit" and manifest["folder"] == "partial"
    assert f"partial (time_limit): {manifest['job']} -> {out}/partial/" in result.stdout
    return manifest


def _rerun(spec: Path, out: Path, item_sleep: float) -> dict:
    """The same job (same work params, so it resumes) with a long limit."""
    manifest = run_job(load_spec(spec, overrides=[
        f"output.url={out}", "request.limit=3m", f"work.params.item_sleep={item_sleep}"]))
    assert manifest["status"] == "completed" and manifest["reason"] == "finished"
    return manifest


# -- inference ---------------------------------------------------------------

def _digits() -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(DATA / "digits.csv.gz", "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    return table[:, :64] / 16.0, table[:, 64].astype(int)


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_inference_predicts_every_row(prefect_api, scratch, tmp_path):
    out = tmp_path / "out"
    manifest = run_job(load_spec(INFERENCE, overrides=[f"output.url={out}"]))
    assert manifest["status"] == "completed" and manifest["reason"] == "finished" and manifest["exit_code"] == 0
    assert _returned(out, manifest) == {"predictions.csv", "metrics.json"}
    assert manifest["step"] == 1797 and _checkpoint_state(out, manifest)["rows_done"] == 1797

    # the predictions are the committed model's, recomputed here row by row
    x, y = _digits()
    model = build_model(64)
    model.load_state_dict(torch.load(DATA / "digits-model.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        probs = torch.softmax(model(torch.from_numpy(x)), dim=1).numpy()
    rows = _read_csv(out / "predictions.csv")
    assert [int(r["row"]) for r in rows] == list(range(1797))
    assert [int(r["label"]) for r in rows] == y.tolist()
    assert [int(r["predicted"]) for r in rows] == probs.argmax(axis=1).tolist()
    assert np.allclose([float(r["confidence"]) for r in rows], probs.max(axis=1), atol=1e-6)

    metrics = json.loads((out / "metrics.json").read_text())
    correct = sum(r["label"] == r["predicted"] for r in rows)
    assert metrics["rows"] == 1797 and metrics["correct"] == correct
    assert metrics["accuracy"] == correct / 1797 and metrics["accuracy"] >= 0.98  # the model saw 80% of these rows
    assert [metrics["per_class"][str(c)]["count"] for c in range(10)] == DIGIT_COUNTS
    for c in range(10):
        tp = sum(r["label"] == r["predicted"] == str(c) for r in rows)
        assert metrics["per_class"][str(c)]["recall"] == tp / DIGIT_COUNTS[c]
        assert metrics["per_class"][str(c)]["precision"] == tp / sum(r["predicted"] == str(c) for r in rows)
    assert metrics["model_sha256"] == _sha(DATA / "digits-model.pt")
    assert metrics["attempts"] == [{"start_row": 0, "rows": 1797}]


def test_inference_stopped_early_returns_finished_rows_then_resumes(prefect_api, scratch, tmp_path, e31):
    out = tmp_path / "out"
    # 18 chunks of 100 rows at 0.8 s each: the stop warning at 10 s comes part-way, also when a loaded
    # machine takes seconds to start the work
    partial = _stop_early(e31, INFERENCE, out, scratch, limit="12s", grace="2s", item_sleep=0.008)
    assert _returned(out, partial) == {"predictions.csv"}  # metrics only at the end
    rows = _read_csv(out / "partial" / "predictions.csv")
    done = len(rows)
    assert 0 < done < 1797 and done % 100 == 0
    assert [int(r["row"]) for r in rows] == list(range(done))
    assert partial["step"] == done and _checkpoint_state(out, partial)["rows_done"] == done
    first_lines = (out / "partial" / "predictions.csv").read_text().splitlines()

    final = _rerun(INFERENCE, out, item_sleep=0.008)
    assert _returned(out, final) == {"predictions.csv", "metrics.json"} and not (out / "partial").exists()
    lines = (out / "predictions.csv").read_text().splitlines()
    assert len(lines) == 1798 and lines[: done + 1] == first_lines
    assert [int(r["row"]) for r in _read_csv(out / "predictions.csv")] == list(range(1797))  # each row once
    metrics = json.loads((out / "metrics.json").read_text())
    # the second attempt started at the first row not done and predicted only the rest
    assert metrics["attempts"] == [{"start_row": 0, "rows": done}, {"start_row": done, "rows": 1797 - done}]
    assert [metrics["per_class"][str(c)]["count"] for c in range(10)] == DIGIT_COUNTS


# -- processing ---------------------------------------------------------------

def _decode(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im)


def _sobel_reference(grey: np.ndarray) -> np.ndarray:
    """Sobel magnitude with scipy.ndimage, scaled to 0..255 like the work's."""
    g = grey.astype(np.float64) / 255.0
    magnitude = np.hypot(ndimage.sobel(g, axis=0), ndimage.sobel(g, axis=1))
    return np.round(magnitude / magnitude.max() * 255.0)


def test_processing_makes_thumbnail_and_edges_of_every_image(prefect_api, scratch, tmp_path):
    out = tmp_path / "out"
    manifest = run_job(load_spec(PROCESSING, overrides=[f"output.url={out}"]))
    assert manifest["status"] == "completed" and manifest["reason"] == "finished"
    names = [f"{n}.png" for n in BACKLOG]
    assert _returned(out, manifest) == {"report.json"} | {f"thumbnails/{n}" for n in names} | {f"edges/{n}" for n in names}
    assert manifest["step"] == 10 and [r["name"] for r in _checkpoint_state(out, manifest)["files"]] == names

    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True and report["total"] == report["processed"] == 10
    assert [r["name"] for r in report["files"]] == names
    assert report["attempts"] == [{"attempt": 1, "skipped": 0, "processed": 10}]
    for record in report["files"]:
        source = _decode(DATA / "backlog" / record["name"])
        assert record["source"]["sha256"] == _sha(DATA / "backlog" / record["name"])
        assert record["source"]["shape"] == list(source.shape) and record["attempt"] == 1
        assert record["seconds"] > 0
        for key in ("thumbnail", "edges"):
            path = out / record[key]["path"]
            assert record[key]["sha256"] == _sha(path) and record[key]["bytes"] == path.stat().st_size
        edges = _decode(out / record["edges"]["path"])
        assert edges.dtype == np.uint8 and edges.shape == source.shape[:2] and edges.max() == 255
        thumb = _decode(out / record["thumbnail"]["path"])
        h, w = source.shape[:2]
        assert thumb.shape == (round(h * 128 / max(h, w)), round(w * 128 / max(h, w))) + source.shape[2:]
        assert list(thumb.shape) == record["thumbnail"]["shape"] and max(thumb.shape[:2]) == 128
    # a grey image's edge map is its Sobel magnitude (recomputed with scipy), up to rounding
    camera = _decode(DATA / "backlog" / "camera.png")
    assert camera.shape == (512, 512)
    assert np.abs(_decode(out / "edges" / "camera.png").astype(float) - _sobel_reference(camera)).max() <= 1


def test_processing_stopped_early_returns_finished_images_then_resumes(prefect_api, scratch, tmp_path, e31):
    out = tmp_path / "out"
    # ten images at ~1.5 s each: the stop warning at 9.5 s comes part-way, also after a slow start
    partial = _stop_early(e31, PROCESSING, out, scratch, limit="12s", grace="2.5s", item_sleep=1.4)
    report = json.loads((out / "partial" / "report.json").read_text())
    done = report["processed"]
    names = [f"{n}.png" for n in BACKLOG]
    assert report["complete"] is False and report["total"] == 10 and 0 < done < 10
    assert [r["name"] for r in report["files"]] == names[:done]  # in name order, only those finished
    assert report["attempts"] == [{"attempt": 1, "skipped": 0, "processed": done}]
    finished = names[:done]
    assert _returned(out, partial) == {"report.json"} | {f"thumbnails/{n}" for n in finished} | {f"edges/{n}" for n in finished}
    assert partial["step"] == done and [r["name"] for r in _checkpoint_state(out, partial)["files"]] == finished
    first = {r["name"]: r for r in report["files"]}

    final = _rerun(PROCESSING, out, item_sleep=1.4)
    assert len(_returned(out, final)) == 21
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True and [r["name"] for r in report["files"]] == names
    assert report["attempts"] == [{"attempt": 1, "skipped": 0, "processed": done},
                                  {"attempt": 2, "skipped": done, "processed": 10 - done}]
    # the images finished before the stop were not redone: same record, made by attempt 1
    assert [r["name"] for r in report["files"] if r["attempt"] == 1] == finished
    assert all(first[r["name"]] == r for r in report["files"] if r["attempt"] == 1)
    for record in report["files"]:
        assert _decode(out / record["edges"]["path"]).shape == tuple(record["source"]["shape"][:2])


# -- simulation ---------------------------------------------------------------

GRID = json.loads((DATA / "sir-grid.json").read_text())
BETAS = [round(0.05 * k, 9) for k in range(1, 21)]
GAMMAS = [round(0.03 * k, 9) for k in range(1, 16)]
POINT_NAMES = [f"beta={b:.3f}_gamma={g:.3f}.json" for b in BETAS for g in GAMMAS]


def _sir(y, t, beta, gamma):
    s, i, _ = y
    return [-beta * s * i, beta * s * i - gamma * i, gamma * i]


def test_simulation_sweeps_the_grid(prefect_api, scratch, tmp_path):
    out = tmp_path / "out"
    manifest = run_job(load_spec(SIMULATION, overrides=[f"output.url={out}"]))
    assert manifest["status"] == "completed" and manifest["reason"] == "finished"
    assert _returned(out, manifest) == {"summary.csv", "summary.png", "report.json"} | {f"points/{n}" for n in POINT_NAMES}
    assert manifest["step"] == 300 and len(_checkpoint_state(out, manifest)["done"]) == 300

    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True and report["total"] == report["done"] == 300
    assert report["grid"]["beta"] == BETAS and report["grid"]["gamma"] == GAMMAS
    assert report["attempts"] == [{"attempt": 1, "skipped": 0, "computed": 300}]
    summary = _read_csv(out / "summary.csv")
    assert [(float(r["beta"]), float(r["gamma"])) for r in summary] == [(b, g) for b in BETAS for g in GAMMAS]
    for row, name in zip(summary, POINT_NAMES):
        point = json.loads((out / "points" / name).read_text())
        assert {k: float(v) for k, v in row.items()} == {k: point[k] for k in row}
    assert report["highest_peak"] == max(
        ({k: float(r[k]) for k in ("beta", "gamma", "peak_infected", "peak_time")} for r in summary),
        key=lambda r: r["peak_infected"])
    with Image.open(out / "summary.png") as im:
        assert im.format == "PNG" and im.size == (1000, 420)

    # one epidemic point recomputed independently
    beta, gamma = 0.5, 0.12
    s0, i0, r0 = GRID["initial"]["S"], GRID["initial"]["I"], GRID["initial"]["R"]
    point = json.loads((out / "points" / "beta=0.500_gamma=0.120.json").read_text())
    assert point["beta"] == beta and point["gamma"] == gamma and point["R0"] == pytest.approx(beta / gamma)
    rho = gamma / beta  # I + S - rho ln S is conserved: the peak (S = rho) in closed form
    assert point["peak_infected"] == pytest.approx(i0 + s0 - rho - rho * math.log(s0 / rho), abs=1e-7)
    t = np.linspace(0, 365, 365_001)
    ref = odeint(_sir, [s0, i0, r0], t, args=(beta, gamma), rtol=1e-11, atol=1e-13)
    assert point["peak_time"] == pytest.approx(t[ref[:, 1].argmax()], abs=0.002)
    assert point["final_recovered"] == pytest.approx(ref[-1, 2], abs=1e-7)
    assert point["final_susceptible"] == pytest.approx(ref[-1, 0], abs=1e-7)
    # and the epidemic is over by day 365: the final size equation holds
    s_inf = brentq(lambda s: s - s0 * math.exp(-(1 - s - r0) / rho), 1e-12, rho)
    assert point["final_recovered"] == pytest.approx(1 - s_inf, abs=1e-6)
    # below the threshold (beta S0 < gamma) infections only fall
    quiet = json.loads((out / "points" / "beta=0.050_gamma=0.060.json").read_text())
    assert quiet["peak_time"] == 0.0 and quiet["peak_infected"] == i0


def test_simulation_stopped_early_returns_finished_points_then_resumes(prefect_api, scratch, tmp_path, e31):
    out = tmp_path / "out"
    # 300 points at ~55 ms each: the stop warning at 10 s comes part-way, also after a slow start
    partial = _stop_early(e31, SIMULATION, out, scratch, limit="12s", grace="2s", item_sleep=0.05)
    report = json.loads((out / "partial" / "report.json").read_text())
    done = report["done"]
    assert report["complete"] is False and report["total"] == 300 and 0 < done < 300
    assert report["attempts"] == [{"attempt": 1, "skipped": 0, "computed": done}]
    finished = POINT_NAMES[:done]  # beta-major order
    assert _returned(out, partial) == {"report.json"} | {f"points/{n}" for n in finished}
    assert partial["step"] == done and sorted(_checkpoint_state(out, partial)["done"]) == sorted(finished)
    first = {n: _sha(out / "partial" / "points" / n) for n in finished}

    final = _rerun(SIMULATION, out, item_sleep=0.05)
    assert len(_returned(out, final)) == 303
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True and report["done"] == 300
    # the second attempt skipped the finished points and computed only the rest
    assert report["attempts"] == [{"attempt": 1, "skipped": 0, "computed": done},
                                  {"attempt": 2, "skipped": done, "computed": 300 - done}]
    assert all(_sha(out / "points" / n) == digest for n, digest in first.items())
    assert len(_read_csv(out / "summary.csv")) == 300
