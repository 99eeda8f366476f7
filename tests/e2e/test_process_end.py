"""The end of a --qreport process: terminal summaries and the interpreter's exit leave the run's heap alone."""
import gc
import subprocess
import sys
import textwrap

from pytest_qreport.core import runtime


def test_every_terminal_summary_runs_with_the_sessions_heap_frozen_and_it_is_thawed_after(pytester):
    pytester.makeconftest('''
        import gc

        FROZEN = []

        def pytest_terminal_summary(terminalreporter):
            FROZEN.append(gc.get_freeze_count())
            terminalreporter.write_line(f"frozen during the summary: {FROZEN[-1]}")
    ''')
    pytester.makepyfile("def test_nothing():\n    pass\n")
    thawed_before = gc.get_freeze_count()
    result = pytester.runpytest_inprocess("--qreport")  # in this process, to see its heap and atexit
    result.assert_outcomes(passed=1)
    frozen = int([line for line in result.outlines if "frozen during" in line][0].split()[-1])
    assert frozen > 1000  # the session's objects, not the handful the summaries made
    assert gc.get_freeze_count() == thawed_before == 0
    assert len(runtime._freezing_at_exit) == 1  # however many sessions this process ran


def test_the_heap_is_frozen_at_exit_before_the_final_collection_and_the_other_handlers_still_run():
    script = textwrap.dedent('''
        import atexit, gc
        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
        from pytest_qreport.core.runtime import freeze_heap_at_exit
        freeze_heap_at_exit()
        freeze_heap_at_exit()
        cycles = [[] for _ in range(1000)]
        for cycle in cycles:
            cycle.append(cycle)
        print("frozen before exit:", gc.get_freeze_count() > 0, flush=True)
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["frozen before exit: False", "frozen at exit: True"]
