"""The watchers of a flow run's cancel (e31.tasks.supervisor.cancel)
against a real ``prefect server start``: every watcher of one run in a
process shares one reader of its state (staging, the wait for the run
ahead and the run each used to read it at their start and every 2 s), and
each sees a cancel made through the API."""

from __future__ import annotations

import time

from tests.deployments.test_run_cache import _Pool


def test_the_watchers_of_one_run_share_one_reader_and_each_sees_its_cancel(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from e31.tasks.supervisor import cancel

    with get_client(sync_client=True) as client:
        run = _Pool(tmp_path).submit(client, "watched")
        with cancel.watching(run) as held:
            assert held.refresh() is False  # the reader's first read has answered
            reader = cancel._READERS[run]
            staging = cancel.CancelWatcher(run)  # started while another watches: nothing read at its start
            assert (cancel._READERS[run], reader.users, cancel.cancel_requested(run)) == (reader, 2, False)
            staging.stop()
            client.set_flow_run_state(run, Cancelling(message="from the test"), force=True)
            deadline = time.monotonic() + 30
            while not held.cancelled():  # seen within POLL_EVERY_S (2 s), without a refresh
                assert time.monotonic() < deadline, "the cancel was never seen"
                time.sleep(0.1)
            late = cancel.CancelWatcher(run)
            assert (late.cancelled(), staging.cancelled(), cancel.cancel_requested(run)) == (True, True, True)
            late.stop()
            assert reader.users == 1
        assert run not in cancel._READERS and reader.done and held.cancelled()  # the last stop ended it
        other = cancel.CancelWatcher(run)  # a watcher after that has a reader of its own, reading at once
        assert other.refresh() is True and cancel._READERS[run] is not reader
        other.stop()
    assert (cancel.CancelWatcher(None).cancelled(), cancel.cancel_requested(None)) == (False, False)
