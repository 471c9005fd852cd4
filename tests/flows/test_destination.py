"""The destination never lies: whatever is killed when, a manifest at the
destination describes exactly the files beside it (their sha256s match), or
there is none, or it says a return is in progress; a run that does not
complete never touches an earlier complete output; an interrupted return is
finished by ``e31 return``.  Real processes, real kill -9, a real S3 server."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e31.tasks.deliver import ReturnTarget
from e31.tasks.outcome import RunOutcome
from e31.tasks.pending import PENDING, save_pending

KILLS = 20  # kill -9 at random moments of a return, per destination kind


def _files(fs, root: str, skip: set[str]) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> content), the manifest
    and the top-level folders in ``skip`` left out."""
    root = fs._strip_protocol(root).rstrip("/")
    try:
        found = fs.find(root)
    except FileNotFoundError:
        return {}
    out = {}
    for path in found:
        rel = path[len(root):].lstrip("/")
        if rel and rel != "manifest.json" and rel.split("/", 1)[0] not in skip:
            out[rel] = fs.cat_file(path)
    return out


def assert_honest(fs, root: str) -> dict[str, dict | None]:
    """The consumer's check, for the top and ``partial/``: no manifest, a
    ``returning`` one, or one whose files (and stale list) are exactly the
    files beside it, each with its sha256.  Returns both manifests."""
    fs.invalidate_cache()
    seen = {}
    for folder, skip in ((root.rstrip("/"), {"partial", "checkpoints"}), (root.rstrip("/") + "/partial", set())):
        try:
            manifest = json.loads(fs.cat_file(f"{folder}/manifest.json"))
        except FileNotFoundError:
            manifest = None
        seen[folder] = manifest
        if manifest is None or manifest["status"] == "returning":
            continue
        assert manifest["status"] in ("completed", "partial", "failed")
        present = _files(fs, folder, skip)
        listed = {f["path"]: f for f in manifest["files"]}
        assert set(present) == set(listed) | set(manifest["stale"]), (folder, sorted(present), sorted(listed))
        for rel, row in listed.items():
            assert hashlib.sha256(present[rel]).hexdigest() == row["sha256"], (folder, rel)
            assert len(present[rel]) == row["bytes"]
    return seen


def _prepare(scratch: Path, job: str, url: str, run_id: str, reason: str, seed: int, sizes: dict[str, int]) -> dict:
    """Lay out a run's output in the job's scratch folder with its pending
    return record, as a run whose destination was down leaves it; returns
    the files' contents."""
    out = scratch / job / "output"
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    rng = random.Random(seed)
    content = {}
    for name, size in sizes.items():
        data = rng.randbytes(size)
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
        content[name] = data
    target = ReturnTarget(job=job, run_id=run_id, output_dir=str(out), output_url=url, declared=["model.pt"],
                          gpus=0, cpus=1, spec_sha256="s" * 64, checkpoint_url=url.rstrip("/") + "/checkpoints")
    save_pending(scratch / job, target, RunOutcome(reason=reason, exit_code=0, run_s=1.0), "destination was down")
    return content


def _e31_return(job: str, env: dict) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("e31")
    return subprocess.Popen([str(exe), "return", job], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_withdrawal(fs, folder: str, run_id: str, proc: subprocess.Popen) -> float | None:
    """Wait until the folder's manifest names ``run_id`` (the return has
    withdrawn the old one); returns when (monotonic seconds), None when the
    process ended first."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            manifest = json.loads(fs.cat_file(f"{folder}/manifest.json"))
        except (FileNotFoundError, ValueError):
            manifest = None
        if manifest and manifest.get("run_id") == run_id:
            return time.monotonic()
        time.sleep(0.005)
    return None


def _kill_during_returns(fs, url: str, scratch: Path, env: dict, sizes: dict[str, int]) -> None:
    job = "killjob"
    first = _prepare(scratch, job, url, "run-0", "finished", 0, sizes)
    done = _e31_return(job, env)
    started = _wait_for_withdrawal(fs, url.rstrip("/"), "run-0", done)
    assert done.wait(timeout=120) == 0, done.stderr.read()
    window = time.monotonic() - started  # how long a whole return takes here: the kills land inside it
    top = assert_honest(fs, url)[url.rstrip("/")]
    assert top["status"] == "completed" and _files(fs, url, {"partial", "checkpoints"}) == first
    rng = random.Random(31)
    kills_in_return = 0
    for i in range(1, KILLS + 1):
        reason = "time_limit" if i % 4 == 0 else "finished"  # some partial runs, into partial/
        names = dict(sizes) if i % 3 else {**{k: v for k, v in list(sizes.items())[1:]}, "extra/new.bin": 4096}
        _prepare(scratch, job, url, f"run-{i}", reason, i, names)
        proc = _e31_return(job, env)
        folder = url.rstrip("/") + ("/partial" if reason != "finished" else "")
        started = _wait_for_withdrawal(fs, folder, f"run-{i}", proc)
        if proc.poll() is None:
            time.sleep(rng.uniform(0, window))
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        fs.invalidate_cache()
        seen = assert_honest(fs, url)
        top = seen[url.rstrip("/")]
        if top is not None and top["status"] != "returning":
            assert top["status"] == "completed"  # a run that does not complete never writes at the top
        mine = seen[folder]
        delivered = mine is not None and mine["run_id"] == f"run-{i}" and mine["status"] != "returning"
        assert (scratch / job / PENDING).exists() != delivered  # a cut return keeps its record until delivered
        kills_in_return += started is not None and not delivered
    assert kills_in_return >= KILLS // 4  # not vacuous: kills did cut returns that had begun
    if (scratch / job / PENDING).exists():
        final = _e31_return(job, env)  # finishes the last interrupted return
        assert final.wait(timeout=120) == 0, final.stderr.read()
    seen = assert_honest(fs, url)
    assert not (scratch / job / PENDING).exists()
    assert not [p for p in fs.find(url.rstrip("/")) if ".e31-part-" in p]  # no temporary left behind
    last = seen[url.rstrip("/") + ("/partial" if KILLS % 4 == 0 else "")]
    assert last["run_id"] == f"run-{KILLS}" and last["status"] in ("completed", "partial")


def test_kill_9_at_random_moments_of_a_local_return(tmp_path, scratch):
    import fsspec

    sizes = {f"part-{i:02d}.bin": 3 * 2**20 for i in range(12)}
    sizes["model.pt"] = 2**20
    _kill_during_returns(fsspec.filesystem("file"), str(tmp_path / "dest"), scratch,
                         {"E31_SCRATCH": str(scratch)}, sizes)


def test_kill_9_at_random_moments_of_an_s3_return(s3_server, s3_prefix, scratch):
    sizes = {f"part-{i:02d}.bin": 2**20 for i in range(12)}
    sizes["model.pt"] = 2**20
    _kill_during_returns(s3_server.filesystem(), s3_prefix + "out/", scratch, {"E31_SCRATCH": str(scratch)}, sizes)
