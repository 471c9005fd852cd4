"""A running ``e31 scheduler`` whose Prefect server freezes: it says so while its tick waits, and says
when the tick goes through (the real session server behind :class:`tests.freezeproxy.FreezeProxy`,
which holds every byte as a stopped server would)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from tests.freezeproxy import FreezeProxy
from tests.procs import stop_group

E31 = str(Path(sys.executable).with_name("e31"))


def _await(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s; the scheduler said:\n" + (
            log.read_text()[-3000:] if log.exists() else "")
        time.sleep(0.2)


def test_a_scheduler_says_while_a_frozen_server_holds_its_tick_and_when_the_tick_ends(prefect_api, tmp_path):
    proxy = FreezeProxy(urlparse(prefect_api).port)
    api = f"http://127.0.0.1:{proxy.port}/api"
    pool = tmp_path / "pool.yaml"
    pool.write_text(json.dumps({"pool_version": 1, "name": f"frozen-{proxy.port}",
                                "nodes": [{"name": "n1", "gpus": 0, "cpus": 1, "memory": "1GiB"}]}))
    log = tmp_path / "scheduler.log"
    env = {**os.environ, "PREFECT_API_URL": api, "E31_API_TIMEOUT_S": "2"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([E31, "scheduler", "--pool", str(pool), "--interval", "0.5"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=tmp_path)
    try:
        # its loop is ticking: the history read and at least two ticks' reads of the pool's runs went through
        _await(lambda: sum(r == "POST /api/flow_runs/filter" for r in proxy.requests) >= 3, 120, "ticks", log)
        proxy.freeze()
        frozen_at = time.monotonic()
        said = (r"e31 scheduler: the tick begun at \d\d:\d\d:\d\d UTC has waited (\d+) s on the server: the Prefect "
                rf"server at {re.escape(api)} did not answer within 2 s \(E31_API_TIMEOUT_S\): it is frozen or "
                r"overloaded; check its process and its database; it goes on when the server answers "
                r"\(Prefect's client gives up on one request after PREFECT_API_REQUEST_TIMEOUT s, then retries it\)$")
        _await(lambda: re.search(said, log.read_text(), re.M), 60, "line about the frozen server", log)
        waited = int(re.search(said, log.read_text(), re.M)[1])
        assert 2 <= waited <= time.monotonic() - frozen_at + 1  # past the limit, said while still frozen
        assert proc.poll() is None
        proxy.thaw()
        _await(lambda: re.search(r"^e31 scheduler: the tick begun at \d\d:\d\d:\d\d UTC ended after \d+ s$",
                                 log.read_text(), re.M), 60, "line saying the tick ended", log)
        assert proc.poll() is None and log.read_text().count("has waited") == 1  # one line: under a minute frozen
    finally:
        stop_group(proc)
        proxy.close()
