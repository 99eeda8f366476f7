"""The forked pytester runs (tests/forked.py): a process of their own, which parallel torch work here cannot hang."""
import pathlib

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


def test_a_run_under_xdist_forks_its_workers_and_leaves_no_process_behind(pytester, monkeypatch):
    pytester.makeconftest('''
        import os
        import sys

        def pytest_configure(config):
            if hasattr(config, "workerinput"):  # a worker: how it started, for the test to read
                with open(f"worker-{os.getpid()}.txt", "w") as out:
                    out.write(f"{'torch' in sys.modules} {os.getcwd()} {os.environ.get('QREPORT_PROBE')}")
    ''')
    pytester.makepyfile("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    monkeypatch.setenv("QREPORT_PROBE", "set by the test")
    result = pytester.runpytest("-n", "2", "-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=2)
    workers = {int(path.stem.split("-")[1]): path.read_text() for path in pytester.path.glob("worker-*.txt")}
    assert len(workers) == 2
    for pid, started in workers.items():
        assert started == f"True {pytester.path} set by the test"  # forked: torch was there before it began
        assert not _running(pid), f"worker {pid} outlived its run"


def _running(pid):
    """Whether a process is running (a zombie, which only waits to be reaped, is not)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
