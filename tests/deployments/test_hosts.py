"""The queue across separate hosts: Linux network namespaces (:mod:`tests.hosts`), one private /24.

Host 0 is the server host: a Prefect server (SQLite, its own), an S3 server (SeaweedFS) and the
``e31 scheduler``, each listening on 10.231.0.1 only.  Hosts 1 and 2 each run an ``e31 worker`` for
one node of the pool, with their own scratch and Prefect home; they reach the server host over the
hosts' network and nothing else.  Jobs are submitted on host 0 with ``e31 submit``, read their input
from the object store and return their output to it; the test reads both through the S3 API from host
0.  (The hosts share the machine's file system: the pool file and the works' scripts sit in one folder
every host reads, as a configuration shared by every machine would.)

These tests need root (network namespaces); without it they skip and say why.  CI runs as root.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from e31.prefect_compat.api import api_ready
from tests.hosts import Hosts, unavailable
from tests.s3server import S3Server

pytestmark = pytest.mark.server  # it starts servers of its own

KEY, SECRET, BUCKET = "e31hostkey", "e31-hosts-secret-Zq4", "e31-hosts"
E31 = str(Path(sys.executable).with_name("e31"))
PORT = 4200
LEASE_S = 25

#: The work: waits until its go file exists (so a test can hold it mid-run), then writes the sha256 of
#: its input and the address it reaches the server host from (its host's own) to its output.
WORK = """
import hashlib, json, os, pathlib, socket, sys, time
out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
data = pathlib.Path(os.environ["E31_DATA_BLOB"])
blob = next(p for p in data.rglob("*") if p.is_file()) if data.is_dir() else data
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((sys.argv[1], 9))  # no packet is sent: this only picks the route and its source address
pathlib.Path(sys.argv[2], f"{os.environ['E31_NODE']}-{os.getpid()}.started").write_text(str(os.getpid()))
go = pathlib.Path(sys.argv[2], "go")
while not go.exists():
    time.sleep(0.1)
(out / "result.json").write_text(json.dumps({
    "sha256": hashlib.sha256(blob.read_bytes()).hexdigest(), "address": probe.getsockname()[0],
    "node": os.environ["E31_NODE"], "pid": os.getpid()}))
"""


class Cluster:
    """The server host's services and one worker per other host."""

    def __init__(self, hosts: Hosts, root: Path, nodes: int) -> None:
        self.hosts, self.root, self.nodes = hosts, root, nodes
        self.server_address = hosts.address(0)
        self.api = f"http://{self.server_address}:{PORT}/api"
        self.prefix = uuid.uuid4().hex[:8]
        self.pool = root / "pool.yaml"
        self.pool.write_text(json.dumps({"pool_version": 1, "name": f"hosts-{self.prefix}", "nodes": [
            {"name": f"n{i}", "gpus": 0, "cpus": 2, "memory": "1GiB"} for i in range(1, nodes + 1)]}))
        (root / "work.py").write_text(WORK)
        self.s3: S3Server | None = None
        self.workers: dict[int, object] = {}

    def env(self, i: int, **extra: str) -> dict[str, str]:
        """Host ``i``'s environment: the server host's API and object store, its own folders."""
        home = self.root / f"host-{i}"
        home.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_", "E31_"))}
        env.update({
            "PREFECT_HOME": str(home / "prefect-home"), "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PREFECT_LOGGING_LEVEL": "WARNING",
            "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL", "E31_SCRATCH": str(home / "scratch"),
            "E31_TRANSFERS_DIR": str(home / "transfers"),
            **(self.s3.env() if self.s3 is not None else {}), **extra})
        return env

    def start(self) -> None:
        hosts = self.hosts
        server = hosts.popen(0, [sys.executable, "-m", "prefect", "server", "start", "--host", self.server_address,
                                 "--port", str(PORT)],
                             env=self.env(0, PREFECT_UI_ENABLED="false", PREFECT_SERVER_UI_API_URL=self.api),
                             log="prefect-server")
        self.s3 = S3Server(self.root / "s3", key=KEY, secret=SECRET, bucket=BUCKET, ip=self.server_address,
                           host=(hosts, 0)).start()
        hosts.wait_for(0, lambda: api_ready(self.api), 180, "the Prefect server on host 0", alive=server)
        # a node silent past a 25 s lease (and LOST_CONFIRM_S more) is taken for lost
        hosts.popen(0, [E31, "scheduler", "--pool", str(self.pool), "--interval", "0.5", "--lease", str(LEASE_S)],
                    env=self.env(0), cwd=self.root, log="scheduler")
        for i in range(1, self.nodes + 1):
            self.workers[i] = hosts.popen(i, [E31, "worker", "--pool", str(self.pool), "--node", f"n{i}"],
                                          env=self.env(i, E31_NODE_GPUS="0"), cwd=self.root, log="worker")

    def client(self):
        """A botocore S3 client for the object store (use it on host 0: :meth:`Hosts.call`)."""
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.s3.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
            region_name="us-east-1", config=botocore.config.Config(retries={"max_attempts": 1}))

    def put(self, key: str, body: bytes) -> None:
        self.hosts.call(0, lambda: self.client().put_object(Bucket=BUCKET, Key=key, Body=body))

    def get(self, key: str) -> bytes | None:
        def read() -> bytes | None:
            try:
                return self.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
            except Exception as exc:  # NoSuchKey: not there yet
                if "NoSuchKey" in type(exc).__name__ or "NoSuchKey" in str(exc):
                    return None
                raise
        return self.hosts.call(0, read)

    def queue(self) -> str:
        """What ``e31 queue`` says on the server host."""
        done = self.hosts.run(0, [E31, "queue", "--pool", str(self.pool)], env=self.env(0), cwd=self.root)
        return done.stdout + done.stderr

    def spec(self, name: str, blob: str, signals: Path, **request: object) -> Path:
        """A job reading ``blob`` (a key of the bucket) whose work waits for ``signals``/go."""
        spec = self.root / f"{name}.yaml"
        spec.write_text(json.dumps({
            "name": name,
            "work": {"kind": "simulation", "command": [sys.executable, str(self.root / "work.py"), self.server_address,
                                                       str(signals)]},
            "data": [{"name": "blob", "url": f"s3://{BUCKET}/{blob}"}],
            "request": {"cpus": 2, "duration": "30s", "limit": "5m", **request},
            "output": {"kind": "results", "url": f"s3://{BUCKET}/{self.prefix}/out/{name}/", "files": ["result.json"]}}))
        return spec

    def submit(self, spec: Path) -> None:
        done = self.hosts.run(0, [E31, "submit", str(spec), "--pool", str(self.pool)], env=self.env(0), cwd=self.root)
        assert done.returncode == 0, done.stderr

    def manifest(self, name: str) -> dict | None:
        body = self.get(f"{self.prefix}/out/{name}/manifest.json")
        manifest = json.loads(body) if body else None
        return manifest if manifest and manifest.get("status") != "returning" else None

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                         for log in sorted(self.root.glob("host-*.log")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three hosts, their services started once for this file's tests (a Prefect server's first start
    takes about 25 s); each test uses keys and job names of its own."""
    why = unavailable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("hosts")
    with Hosts(3, root) as hosts:
        c = Cluster(hosts, root, nodes=2)
        try:
            c.start()
            yield c
        except BaseException:
            print(c.logs())
            raise
        finally:
            for proc in list(hosts.procs):
                hosts.stop(proc)
            if c.s3 is not None:
                c.s3.stop()


def wait_for(predicate, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout:g} s\n{cluster.logs()}")
        time.sleep(0.3)


def test_the_queue_runs_each_job_on_a_worker_of_another_host_from_and_to_the_object_store(cluster, tmp_path):
    blob = os.urandom(256 * 1024)
    cluster.put(f"{cluster.prefix}/in/blob.bin", blob)
    signals = tmp_path
    for name in ("job-a", "job-b"):
        cluster.submit(cluster.spec(name, f"{cluster.prefix}/in/blob.bin", signals))
    # each job asks for both CPUs of a node: they run at once only on the two worker hosts
    wait_for(lambda: sorted(p.name.split("-")[0] for p in signals.glob("*.started")) == ["n1", "n2"], 240,
             "both jobs running, one per node", cluster)
    (signals / "go").touch()
    wait_for(lambda: all(cluster.manifest(n) for n in ("job-a", "job-b")), 180, "both outputs returned", cluster)
    results = {n: json.loads(cluster.get(f"{cluster.prefix}/out/{n}/result.json")) for n in ("job-a", "job-b")}
    want = hashlib.sha256(blob).hexdigest()
    assert {r["sha256"] for r in results.values()} == {want}
    # a job on node n<i> reached the server host from host i's address, and staged into host i's scratch
    assert sorted((r["node"], r["address"]) for r in results.values()) == [("n1", "10.231.0.2"), ("n2", "10.231.0.3")]
    for name, r in results.items():
        host = int(r["node"][1:])
        assert cluster.manifest(name)["status"] == "completed"
        assert (cluster.root / f"host-{host}" / "scratch" / name).is_dir()
        assert not (cluster.root / f"host-{3 - host}" / "scratch" / name).exists()


def test_a_two_node_training_meets_across_hosts_stops_at_its_limit_and_resumes_exactly(cluster, tmp_path):
    """One job on both worker hosts: the lead on one, its member on the other, meeting over the hosts'
    network at the address the lead reaches the server host from (gloo).  Its time limit stops both ranks
    at the step the lead checkpointed to the object store; submitted again, both ranks resume from that
    step and finish with one model."""
    from tests.deployments.test_gang_live import gang_spec

    def spec(limit: str) -> Path:
        return gang_spec(cluster.root, f"s3://{BUCKET}/{cluster.prefix}/out/gang-hosts/", 600, 0.1,
                         name="gang-hosts", cpus=2, limit=limit, grace="5s")

    def partial() -> dict | None:
        body = cluster.get(f"{cluster.prefix}/out/gang-hosts/partial/manifest.json")
        manifest = json.loads(body) if body else None
        return manifest if manifest and manifest.get("status") != "returning" else None

    cluster.submit(spec("40s"))  # past the ranks' start and several checkpoints, also when loaded
    wait_for(partial, 240, "the partial output of the first run", cluster)
    first = partial()
    stopped = first["step"]
    cluster.submit(spec("5m"))
    wait_for(lambda: cluster.manifest("gang-hosts"), 240, "the resumed run's output", cluster)
    done = cluster.manifest("gang-hosts")
    lead = json.loads(cluster.get(f"{cluster.prefix}/out/gang-hosts/seen.json"))
    lead_host = int(lead["node"][1:])
    member_host = 3 - lead_host
    member = json.loads((cluster.root / f"host-{member_host}" / "scratch" / "gang-hosts" / "member" / "output" /
                         "seen.json").read_text())
    assert (first["reason"], done["status"], done["step"], done["resumed_from_step"]) == (
        "time_limit", "completed", 600, stopped)
    assert 0 < stopped < 600
    assert lead["master"] == member["master"] == f"10.231.0.{lead_host + 1}"  # the lead's host, seen from both
    assert (lead["rank"], member["rank"], member["node"]) == (0, 1, f"n{member_host}")
    assert (lead["start"], member["start"], lead["done"], member["done"]) == (stopped, stopped, 600, 600)
    assert lead["weights"] == member["weights"]


def test_a_worker_host_cut_off_mid_run_returns_the_output_once_its_link_is_back(cluster, tmp_path):
    blob = os.urandom(64 * 1024)
    cluster.put(f"{cluster.prefix}/in/cut.bin", blob)
    signals = tmp_path
    cluster.submit(cluster.spec("cut", f"{cluster.prefix}/in/cut.bin", signals))
    wait_for(lambda: any(signals.glob("*.started")), 240, "the job running", cluster)
    (started,) = signals.glob("*.started")
    host = int(started.name.split("-")[0][1:])
    pid = int(started.read_text())
    cluster.hosts.cut(host)
    try:
        (signals / "go").touch()  # the work ends while its host is cut off: the output cannot be returned yet
        time.sleep(8)  # the outage's length (nothing to await): a blip, shorter than a node is given before it is lost
        assert cluster.get(f"{cluster.prefix}/out/cut/result.json") is None
    finally:
        cluster.hosts.restore(host)
    wait_for(lambda: cluster.manifest("cut"), 240, "the output returned after the link came back", cluster)
    manifest = cluster.manifest("cut")
    result = json.loads(cluster.get(f"{cluster.prefix}/out/cut/result.json"))
    assert manifest["status"] == "completed"
    assert (result["sha256"], result["pid"], result["node"]) == (hashlib.sha256(blob).hexdigest(), pid, f"n{host}")
    assert [p.name for p in signals.glob("*.started")] == [started.name]  # it ran once, on one host


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_host_cut_off_past_the_lease_is_fenced_and_one_whole_output_comes_back_once_it_returns(
        cluster, tmp_path):
    """Host h cut off while its job runs: past the lease its node is taken for lost and the run, with a
    retry, is queued again behind the node's fence (a silent host promises nothing): no other attempt
    starts while h is away.  The work ends while h is still cut off, so its flow process holds an
    output it cannot return.  Once the link is back either that attempt returns its output (its work
    ran whole) or h's worker stops it and the run's next attempt runs; which of the two wins is a race
    the design allows.  Either way exactly one output comes back, from the newest work that ran, the
    run ends Completed, the manifest describes exactly the files beside it, and no two works of the
    job ever ran at once."""
    blob = os.urandom(64 * 1024)
    cluster.put(f"{cluster.prefix}/in/fenced.bin", blob)
    signals = tmp_path
    cluster.submit(cluster.spec("fenced", f"{cluster.prefix}/in/fenced.bin", signals, retries=1))
    wait_for(lambda: any(signals.glob("*.started")), 240, "the job running", cluster)
    (first,) = signals.glob("*.started")
    host, stale = int(first.name.split("-")[0][1:]), int(first.read_text())
    cluster.hosts.cut(host)
    try:
        wait_for(lambda: f"waiting for its attempt on node n{host}, lost while it ran, to be confirmed ended"
                 in cluster.queue(), LEASE_S + 120, "the run queued again behind the lost node's fence", cluster)
        (signals / "go").touch()  # the stale work ends now, cut off: its output waits in its scratch
        wait_for(lambda: not _alive(stale), 60, "the stale work's end", cluster)
        stale_ended = time.time()
        assert cluster.get(f"{cluster.prefix}/out/fenced/result.json") is None
        assert list(signals.glob("*.started")) == [first]  # nothing else starts while the fence stands
    finally:
        cluster.hosts.restore(host)
    # the run out of the queue (ended) with a completed output: every start that could happen has happened
    wait_for(lambda: (cluster.manifest("fenced") or {}).get("status") == "completed" and "fenced" not in
             cluster.queue(), 240, "the run ended with a completed output", cluster)
    starts = sorted(signals.glob("*.started"), key=lambda p: p.stat().st_mtime)
    assert len(starts) in (1, 2), starts
    if len(starts) == 2:  # h's worker stopped the stale attempt; the next one ran after it, not beside it
        assert starts[1].stat().st_mtime > stale_ended
    result_bytes = cluster.get(f"{cluster.prefix}/out/fenced/result.json")
    result = json.loads(result_bytes)
    assert (result["sha256"], result["pid"]) == (hashlib.sha256(blob).hexdigest(), int(starts[-1].read_text()))
    manifest = cluster.manifest("fenced")
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {
        "result.json": hashlib.sha256(result_bytes).hexdigest()}


def test_a_gang_members_host_cut_off_mid_run_is_queued_again_and_resumes_once_its_link_is_back(cluster, tmp_path):
    """A 2-node training whose member's host is cut off mid-run (its switch port down): the lead's rank
    waits in its collective for a peer that is silent; past the lease the member's node is taken for lost,
    the run crashed and fenced there (the lead stops its work on reading it) and queued again behind the
    fence.  Once the link is back, the stale member stops its work and writes nothing the job keeps, the
    member's worker answers, and the run's next attempt resumes both ranks from the lead's newest durable
    checkpoint and returns one whole output."""
    from tests.deployments.test_gang_live import gang_spec

    name = "gang-cut"
    cluster.submit(gang_spec(cluster.root, f"s3://{BUCKET}/{cluster.prefix}/out/{name}/", 400, 0.1, name=name,
                             cpus=2, limit="10m", retries=1))

    def member_host() -> int | None:
        for i in (1, 2):
            if (cluster.root / f"host-{i}" / "scratch" / name / "member" / "run" / "child.json").exists():
                return i
        return None

    def durable() -> bool:
        listed = cluster.hosts.call(0, lambda: cluster.client().list_objects_v2(
            Bucket=BUCKET, Prefix=f"{cluster.prefix}/out/{name}/checkpoints/"))
        return any(o["Key"].endswith("/COMMITTED") for o in listed.get("Contents", []))

    wait_for(lambda: member_host() is not None and durable(), 240, "the gang past a durable checkpoint", cluster)
    cut = member_host()
    lead_work = int((cluster.root / f"host-{3 - cut}" / "scratch" / name / "run" / "child.pgid").read_text())
    cluster.hosts.cut(cut)
    try:
        wait_for(lambda: f"waiting for its attempt on node n{cut}, lost while it ran, to be confirmed ended"
                 in cluster.queue(), LEASE_S + 120, "the gang queued again behind the member node's fence", cluster)
        # the lead's flow process reads its run queued again (within 10 s) and stops its work; had the link come
        # back first, the run could be placed back on the same two nodes before that read, and the first
        # process, still running it there, would finish it (a second start on its node leaves it to the first)
        wait_for(lambda: _group_gone(lead_work), 60, "the lead's work of the lost try stopped", cluster)
    finally:
        cluster.hosts.restore(cut)
    wait_for(lambda: cluster.manifest(name), 300, "the gang's output after the link came back", cluster)
    done = cluster.manifest(name)
    lead = json.loads(cluster.get(f"{cluster.prefix}/out/{name}/seen.json"))
    member_host_now = 3 - int(lead["node"][1:])
    member = json.loads((cluster.root / f"host-{member_host_now}" / "scratch" / name / "member" / "output" /
                         "seen.json").read_text())
    assert (done["status"], done["step"]) == ("completed", 400)
    assert 10 <= done["resumed_from_step"] == lead["start"] == member["start"] < 400
    assert (lead["done"], member["done"]) == (400, 400) and lead["weights"] == member["weights"]
    model = cluster.get(f"{cluster.prefix}/out/{name}/model.pt")
    assert {f["path"]: f["sha256"] for f in done["files"]}["model.pt"] == hashlib.sha256(model).hexdigest()


def _group_gone(pgid: int) -> bool:
    """Whether no process of the process group ``pgid`` is left (the hosts share this machine's processes)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False

