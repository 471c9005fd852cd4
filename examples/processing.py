"""The image-processing example work: a pass over a backlog of images,
making a thumbnail and a Sobel edge map of each.

Entry point ``e31.examples.processing:process`` (see
``specs/examples/image-processing.yaml``).  Data: ``backlog``, a folder of
images (``.png``, ``.jpg``, ``.jpeg``, ``.tif``, ``.tiff``, ``.bmp``; other
files are ignored), processed in name order.  Params (all optional):
``thumb_size`` (longest side of a thumbnail in pixels, 128), ``item_sleep``
(seconds slept per image, to stand in for slower work in tests of early
stops; 0).

Writes, per image ``NAME.EXT``, ``thumbnails/NAME.png`` (the image, colour
kept, scaled so its longer side is ``thumb_size``) and ``edges/NAME.png``
(the Sobel gradient magnitude of its grey levels, scaled to 0..255, 8-bit
grey, the image's own height x width), and ``report.json``: ``complete``
(every image done), ``total``, ``processed``, ``files`` (per image in name
order: ``name``, ``attempt`` (1 = the first attempt of the job),
``seconds``, and for the ``source`` and each output its ``path``,
``bytes``, ``sha256`` and ``shape``), ``seconds`` (the sum) and ``attempts``
(per attempt: ``skipped`` images already done and ``processed`` by it).

After each image a checkpoint ``{"files": [...records...], "attempts":
[...], "outputs": {path: PNG bytes}}`` is saved with step = images done.
A resumed attempt starts with an empty output folder (only the checkpoint
carries over): it writes the outputs its checkpoint holds back, each
checked against its record's sha256, and skips those images; on
``ctx.should_stop`` it writes the report of the images finished so far
(``"complete": false``) and returns.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp"}
THUMBS = "thumbnails"
EDGES = "edges"
REPORT = "report.json"


def list_images(folder: Path) -> list[Path]:
    """The images in ``folder`` (not its subfolders), in name order."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def read_image(path: Path) -> np.ndarray:
    """``path`` as a uint8 array: ``[h, w]`` for grey images, ``[h, w, 3]``
    for colour ones (alpha and palettes dropped)."""
    with Image.open(path) as im:
        if im.mode not in ("L", "RGB"):
            im = im.convert("L" if im.mode in ("1", "I", "I;16", "F", "LA") else "RGB")
        return np.asarray(im, dtype=np.uint8)


def edge_map(image: np.ndarray) -> np.ndarray:
    """Sobel gradient magnitude of the image's grey levels as uint8
    ``[h, w]``, scaled so the strongest edge is 255 (all 0 for a flat image)."""
    from skimage.color import rgb2gray
    from skimage.filters import sobel

    grey = rgb2gray(image) if image.ndim == 3 else image.astype(np.float64) / 255.0
    magnitude = sobel(grey)
    peak = float(magnitude.max())
    scaled = magnitude / peak if peak > 0 else magnitude
    return np.round(np.clip(scaled, 0.0, 1.0) * 255.0).astype(np.uint8)


def thumbnail(image: np.ndarray, size: int) -> np.ndarray:
    """``image`` scaled (anti-aliased) so its longer side is ``size`` pixels, uint8."""
    from skimage.transform import resize

    h, w = image.shape[:2]
    scale = size / max(h, w)
    shape = (max(1, round(h * scale)), max(1, round(w * scale))) + image.shape[2:]
    small = resize(image, shape, order=1, anti_aliasing=True, preserve_range=True)
    return np.round(np.clip(small, 0, 255)).astype(np.uint8)


def png_bytes(array: np.ndarray) -> bytes:
    """``array`` (uint8 ``[h, w]`` or ``[h, w, 3]``) encoded as PNG."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _write(path: Path, data: bytes) -> dict:
    """Write ``data`` to ``path`` whole (temporary name, then rename);
    returns ``bytes`` and ``sha256``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def process_one(path: Path, output_dir: Path, thumb_size: int) -> dict:
    """Make the thumbnail and edge map of one image; returns its record
    (without ``attempt``)."""
    started = time.perf_counter()
    data = path.read_bytes()
    image = read_image(path)
    stem = path.stem
    edges = edge_map(image)
    thumb = thumbnail(image, thumb_size)
    record = {
        "name": path.name,
        "source": {"path": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                   "shape": list(image.shape)},
        "thumbnail": {"path": f"{THUMBS}/{stem}.png", **_write(output_dir / THUMBS / f"{stem}.png", png_bytes(thumb)),
                      "shape": list(thumb.shape)},
        "edges": {"path": f"{EDGES}/{stem}.png", **_write(output_dir / EDGES / f"{stem}.png", png_bytes(edges)),
                  "shape": list(edges.shape)},
    }
    record["seconds"] = round(time.perf_counter() - started, 4)
    return record


def _write_back(output_dir: Path, record: dict, outputs: dict[str, bytes]) -> bool:
    """Write both outputs of ``record`` from a checkpoint's ``outputs`` into
    ``output_dir``; False (nothing written) when one is missing there or
    differs from its recorded sha256."""
    paths = [record[key]["path"] for key in ("thumbnail", "edges")]
    sums = [record[key]["sha256"] for key in ("thumbnail", "edges")]
    if any(p not in outputs or hashlib.sha256(outputs[p]).hexdigest() != s for p, s in zip(paths, sums)):
        return False
    for path in paths:
        _write(output_dir / path, outputs[path])
    return True


def write_report(output_dir: Path, records: dict[str, dict], names: list[str], attempts: list[dict]) -> dict:
    """Write ``report.json`` (see the module docstring); returns it."""
    files = [records[n] for n in names if n in records]
    report = {
        "complete": len(files) == len(names),
        "total": len(names),
        "processed": len(files),
        "files": files,
        "seconds": round(sum(r["seconds"] for r in files), 4),
        "attempts": attempts,
    }
    _write(output_dir / REPORT, json.dumps(report, indent=2).encode())
    return report


def process(ctx) -> dict:
    """Process the backlog, checkpointing after each image; see the module
    docstring.  Returns the report (``complete`` false when stopped early)."""
    p = {"thumb_size": 128, "item_sleep": 0.0}
    p.update(ctx.params)
    thumb_size = int(p["thumb_size"])
    if thumb_size < 1:
        raise ValueError(f"thumb_size must be >= 1 (got {thumb_size})")
    images = list_images(ctx.data["backlog"])
    if len({i.stem for i in images}) != len(images):
        raise ValueError(f"{ctx.data['backlog']}: two images share a name (outputs are NAME.png)")
    names = [i.name for i in images]
    out = ctx.output_dir

    records: dict[str, dict] = {}
    attempts: list[dict] = []
    outputs: dict[str, bytes] = {}  # the finished images' output files, kept in the checkpoint
    restored = ctx.restore()
    if restored is not None:
        state, _ = restored
        outputs = dict(state.get("outputs", {}))
        records = {r["name"]: dict(r) for r in state["files"] if r["name"] in names and _write_back(out, r, outputs)}
        outputs = {r[k]["path"]: outputs[r[k]["path"]] for r in records.values() for k in ("thumbnail", "edges")}
        attempts = [dict(a) for a in state["attempts"]]
    attempt = {"attempt": len(attempts) + 1, "skipped": len(records), "processed": 0}
    attempts.append(attempt)
    ctx.progress(len(records), len(names))

    for image in images:
        if image.name in records:
            continue
        if ctx.should_stop:
            break
        record = process_one(image, out, thumb_size)
        if p["item_sleep"]:
            time.sleep(float(p["item_sleep"]))
        record["attempt"] = attempt["attempt"]
        records[image.name] = record
        for key in ("thumbnail", "edges"):
            outputs[record[key]["path"]] = (out / record[key]["path"]).read_bytes()
        attempt["processed"] += 1
        ctx.checkpoint({"files": [records[n] for n in names if n in records], "attempts": attempts,
                        "outputs": outputs}, step=len(records))
        ctx.progress(len(records), len(names))
    return write_report(out, records, names, attempts)
