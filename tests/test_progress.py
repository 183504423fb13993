"""Progress lines: the mean loss over the steps since the last line; after a restart (an
in-place recovery or a restore to an earlier step) only the steps trained since, said so."""
import io

from mpickpt.progress import ProgressLog


def _lines(log: ProgressLog) -> list[str]:
    return log.stream.getvalue().splitlines()


def test_a_line_after_a_restart_covers_only_the_steps_since_and_says_so():
    log = ProgressLog(True, 10, 5, stream=io.StringIO())
    for step, loss in ((1, 9.0), (2, 9.0), (3, 9.0), (4, 9.0)):  # 3 and 4 were undone
        log.step(step, loss, 100)
    log.restart_at(2)
    for step, loss in ((3, 1.0), (4, 2.0), (5, 3.0)):
        log.step(step, loss, 100)
    for step in range(6, 11):
        log.step(step, 4.0, 100)
    first, second = _lines(log)
    assert first.startswith("step 5/10  loss 2.000000  ") and \
        first.endswith(" samples/s  (steps 3-5, since the restart)"), first
    assert second.startswith("step 10/10  loss 4.000000  ") and second.endswith(" samples/s")


def test_a_runs_start_says_nothing_of_a_restart():
    log = ProgressLog(True, 4, 2, stream=io.StringIO())
    log.restart_at(0, said=False)
    for step in (1, 2):
        log.step(step, 0.5, 10)
    assert _lines(log)[0].startswith("step 2/4  loss 0.500000  ")
    assert _lines(log)[0].endswith(" samples/s"), _lines(log)
