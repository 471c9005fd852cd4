"""Words of ``e31 queue`` that need no server: a crashed run's message is cut at a word's end."""

from __future__ import annotations

from types import SimpleNamespace

from e31.deployments.runwords import clip, crashed_line


def test_a_long_crash_message_is_cut_at_a_word_end():
    message = ("node n1's e31 worker has not answered for 75 s (past the scheduler's lease); its resources are free "
               "again")
    run = SimpleNamespace(state=SimpleNamespace(message=message), run_count=1)  # a run as e31 queue reads it
    assert crashed_line(run, 2) == (
        "crashed (node n1's e31 worker has not answered for 75 s (past the scheduler's lease)...); queued again at the "
        "scheduler's next tick: attempt 2 of 3")
    assert clip("short", 80) == "short"
    assert clip("x" * 100, 10) == "xxxxxxx..."
    assert clip("one two, three", 12) == "one two..."
