"""e31.prefect_compat.tags: a tag change lost to a concurrent writer's overwrite is made again (real server)."""

from __future__ import annotations

from prefect import flow
from prefect.client.orchestration import get_client

from e31.prefect_compat.tags import change_tags


@flow
def _tagged() -> None:
    pass


class _Overwritten:
    """The sync client, with another writer's write landing right after our first one: that writer read the
    tags before our write, so its list lacks our tag."""

    def __init__(self, client, theirs: list[str]):
        self.client, self.theirs, self.updates = client, theirs, 0

    def read_flow_run(self, run_id):
        return self.client.read_flow_run(run_id)

    def update_flow_run(self, run_id, tags):
        self.updates += 1
        self.client.update_flow_run(run_id, tags=tags)
        if self.updates == 1:
            self.client.update_flow_run(run_id, tags=self.theirs)


def test_a_tag_overwritten_by_another_writer_is_written_again_with_theirs_kept(prefect_api):
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(_tagged, tags=["e31-job", "e31-attempt:1"])
        racing = _Overwritten(client, ["e31-job", "e31-attempt:1", "e31-staged"])
        assert change_tags(racing, run.id, lambda tags: [*(t for t in tags if t != "e31-attempt:1"), "e31-attempt:2"])
        assert sorted(client.read_flow_run(run.id).tags) == ["e31-attempt:2", "e31-job", "e31-staged"]
        assert racing.updates == 2
        # a change already made writes nothing
        assert change_tags(racing, run.id, lambda tags: [*tags, "e31-job"]) and racing.updates == 2


def test_a_change_that_keeps_being_overwritten_gives_up_after_its_tries_and_says_so(prefect_api):
    class _AlwaysOverwritten(_Overwritten):
        def update_flow_run(self, run_id, tags):
            self.updates += 1
            self.client.update_flow_run(run_id, tags=tags)
            self.client.update_flow_run(run_id, tags=self.theirs)

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(_tagged, tags=["e31-job"])
        racing = _AlwaysOverwritten(client, ["e31-job", "e31-staged"])
        assert not change_tags(racing, run.id, lambda tags: [*tags, "e31-mine"], tries=3)
        assert racing.updates == 3
        assert sorted(client.read_flow_run(run.id).tags) == ["e31-job", "e31-staged"]


def test_a_flow_process_tags_its_times_on_the_server_s_clock(prefect_api, monkeypatch):
    """A node whose clock is 2 minutes behind the server's: the work-ended and checkpoint tags carry the
    server's time (this machine's time plus the offset measured from the server's answers), which the
    queue judges against its own reading of the server's clock.  The offset is set here, as this machine
    cannot move its clock for one process; the measurement itself is tested in test_liveness."""
    import e31.prefect_compat.clock as clock
    from e31.tasks.supervisor import marks

    monkeypatch.setenv("E31_NODE", "n1")
    monkeypatch.setattr(clock, "measure", lambda client: 120.0)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(_tagged, tags=["e31-job"])
        assert marks.mark_work_ended(str(run.id), at=1_800_000_000.0)
        assert "e31-work-ended:0:2027-01-15T08:02:00Z" in client.read_flow_run(run.id).tags
        marks.mark_checkpoint(str(run.id), at=1_800_000_000.0)  # written from a thread: awaited
        import time

        deadline = time.monotonic() + 30
        while "e31-checkpoint:0:1800000120" not in client.read_flow_run(run.id).tags:
            assert time.monotonic() < deadline, client.read_flow_run(run.id).tags
            time.sleep(0.1)
