"""The forked pytester runs (tests/forked.py): a process of their own, which parallel torch work here cannot hang."""
import torch


def test_a_run_after_parallel_torch_work_here_finishes_and_changes_nothing_here(pytester):
    pytester.makepyfile(test_child='''
        import atexit
        import os

        import torch

        import tests.forked

        def test_work():
            square = torch.randn(1500, 1500)
            assert (square @ square).sum(dim=0).shape == (1500,)
            tests.forked.CHILD_WAS_HERE = os.getpid()
            atexit.register(lambda: print("the child's exit handler ran", flush=True))
    ''')
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the child starts as this process is: with OpenMP's team of two started
    try:
        square = torch.randn(1500, 1500)
        (square @ square).sum(dim=0)
        result = pytester.runpytest("-p", "no:cacheprovider", "-s", timeout=120)
    finally:
        torch.set_num_threads(previous)
    result.assert_outcomes(passed=1)
    assert "the child's exit handler ran" in result.stdout.str()
    import tests.forked

    assert not hasattr(tests.forked, "CHILD_WAS_HERE")  # the child's module state stayed there


def test_a_run_that_asks_for_more_threads_runs_as_a_subprocess(pytester):
    pytester.makeconftest('''
        import sys

        def pytest_sessionfinish(session):
            print("torch imported at start:", START, flush=True)

        START = "torch" in sys.modules
    ''')
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--qreport-threads", "2", "-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "torch imported at start: False" in result.stdout.str()  # a fresh interpreter, not a fork of this one
