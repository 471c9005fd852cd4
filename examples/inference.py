"""The bulk-inference example work: run a trained digits classifier over
every row of the UCI handwritten digits and write its predictions.

Entry point ``e31.examples.inference:infer`` (see
``specs/examples/digits-inference.yaml``).  Data: ``digits`` (the gzipped
CSV read by :func:`e31.examples.digits.load_digits_csv`) and ``model`` (a
``state_dict`` of :func:`e31.examples.digits.build_model`, as
``e31.examples.digits:train`` writes it; the hidden width is read from it).
Params (all optional): ``chunk_size`` (rows per chunk, 100), ``item_sleep``
(seconds slept per row, to stand in for a slower model in tests of early
stops; 0).

Writes ``predictions.csv`` (``row,label,predicted,confidence``: the row
index in the data, the true label, the predicted label and the softmax
probability of the prediction, one line per row in row order) and, once
every row is done, ``metrics.json``: ``rows``, ``correct``, ``accuracy``, per
class ``precision``/``recall``/``count`` (count = rows whose true label is
the class), the ``confusion`` matrix (true x predicted), the model's
``model_sha256`` and ``attempts`` (per attempt: ``start_row`` and ``rows``
predicted by it), all computed from ``predictions.csv`` itself.

Rows go in chunks; after each chunk is appended to ``predictions.csv`` a
checkpoint ``{"rows_done": n, "rows": the n finished lines, "attempts":
[...]}`` is saved with step = n.  A resumed attempt starts with an empty
output folder (only the checkpoint carries over): it writes the
checkpoint's ``rows`` back to ``predictions.csv`` and goes on from there; on ``ctx.should_stop`` it returns after the current
chunk with the predictions finished so far.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from e31.examples.digits import N_CLASSES, build_model, load_digits_csv

HEADER = "row,label,predicted,confidence"
PREDICTIONS = "predictions.csv"
METRICS = "metrics.json"


def load_model(path: Path, device: torch.device) -> torch.nn.Module:
    """The classifier saved as a ``state_dict`` at ``path`` (loaded with
    ``weights_only=True``), in eval mode on ``device``."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(int(state["0.weight"].shape[0]))
    model.load_state_dict(state)
    return model.to(device).eval()


def predict(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(predicted label int64 [n], confidence float32 [n])`` for rows ``x``."""
    with torch.no_grad():
        probs = torch.softmax(model(x), dim=1)
    confidence, predicted = probs.max(dim=1)
    return predicted.cpu(), confidence.cpu()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_predictions(path: Path) -> list[tuple[int, int, int, float]]:
    """The rows of a predictions file, ``(row, label, predicted, confidence)``,
    stopping at the first line that is torn or out of order."""
    rows: list[tuple[int, int, int, float]] = []
    if not path.is_file():
        return rows
    lines = path.read_text().split("\n")
    if not lines or lines[0] != HEADER:
        return rows
    for line in lines[1:]:
        parts = line.split(",")
        try:
            row = (int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3]))
        except (ValueError, IndexError):
            break
        if len(parts) != 4 or row[0] != len(rows):
            break
        rows.append(row)
    return rows


def _write_rows(path: Path, rows: str, rows_done: int) -> int:
    """Write ``path`` anew: its header and the first ``rows_done`` lines of
    ``rows`` (a checkpoint's finished rows; fewer when fewer are there);
    returns how many rows it wrote."""
    kept = rows.splitlines(keepends=True)[:rows_done]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{HEADER}\n" + "".join(kept))
    os.replace(tmp, path)
    return len(kept)


def _format(row: tuple[int, int, int, float]) -> str:
    return f"{row[0]},{row[1]},{row[2]},{row[3]:.6f}"


def metrics_of(rows: list[tuple[int, int, int, float]]) -> dict:
    """Accuracy, per-class precision/recall/count and the confusion matrix
    of prediction rows ``(row, label, predicted, confidence)``."""
    confusion = [[0] * N_CLASSES for _ in range(N_CLASSES)]
    for _, label, predicted, _ in rows:
        confusion[label][predicted] += 1
    correct = sum(confusion[c][c] for c in range(N_CLASSES))
    per_class = {}
    for c in range(N_CLASSES):
        count = sum(confusion[c])
        predicted_c = sum(confusion[t][c] for t in range(N_CLASSES))
        per_class[str(c)] = {
            "precision": confusion[c][c] / predicted_c if predicted_c else 0.0,
            "recall": confusion[c][c] / count if count else 0.0,
            "count": count,
        }
    return {
        "rows": len(rows),
        "correct": correct,
        "accuracy": correct / len(rows) if rows else 0.0,
        "per_class": per_class,
        "confusion": confusion,
    }


def infer(ctx) -> dict | None:
    """Predict every row, checkpoint each chunk, write the outputs; see the
    module docstring.  Returns the metrics, or None when stopped early."""
    p = {"chunk_size": 100, "item_sleep": 0.0}
    p.update(ctx.params)
    chunk = int(p["chunk_size"])
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1 (got {chunk})")
    device = torch.device(ctx.device)
    x, y = load_digits_csv(ctx.data["digits"])
    model = load_model(ctx.data["model"], device)
    total = len(y)

    out = ctx.output_dir / PREDICTIONS
    rows_done, attempts, rows = 0, [], ""  # rows: the finished lines of predictions.csv, kept in the checkpoint
    restored = ctx.restore()
    if restored is not None:
        state, _ = restored
        rows_done = int(state["rows_done"])
        rows = str(state.get("rows", ""))
        attempts = [dict(a) for a in state.get("attempts", [])]
    rows_done = _write_rows(out, rows, rows_done)  # a fresh start writes just the header
    rows = "".join(rows.splitlines(keepends=True)[:rows_done])
    attempts.append({"start_row": rows_done, "rows": 0})
    ctx.progress(rows_done, total)

    with open(out, "a") as fh:
        while rows_done < total:
            end = min(rows_done + chunk, total)
            predicted, confidence = predict(model, x[rows_done:end].to(device))
            if p["item_sleep"]:
                time.sleep(float(p["item_sleep"]) * (end - rows_done))
            chunk_rows = "".join(
                _format((i, int(y[i]), int(predicted[i - rows_done]), float(confidence[i - rows_done])))
                + "\n" for i in range(rows_done, end)
            )
            fh.write(chunk_rows)
            fh.flush()
            rows += chunk_rows
            attempts[-1]["rows"] += end - rows_done
            rows_done = end
            ctx.checkpoint({"rows_done": rows_done, "rows": rows, "attempts": attempts}, step=rows_done)
            ctx.progress(rows_done, total)
            if ctx.should_stop and rows_done < total:
                return None

    rows = read_predictions(out)
    if len(rows) != total:
        raise RuntimeError(f"{out}: {len(rows)} whole rows, expected {total}")
    metrics = metrics_of(rows)
    metrics.update({"model_sha256": _sha256(Path(ctx.data["model"])), "chunk_size": chunk, "attempts": attempts})
    tmp = ctx.output_dir / f".{METRICS}.tmp"
    tmp.write_text(json.dumps(metrics, indent=2, sort_keys=True))
    os.replace(tmp, ctx.output_dir / METRICS)
    return metrics
