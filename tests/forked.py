"""pytester runs in a forked child of the test process: a process of its own for each run, as `--runpytest=subprocess`
gives, without its 3 seconds of importing torch, dynamo and export again (the test process imported them: see
conftest.py). Nothing the child does reaches the test process; what the child starts with is the test process as it
is, so a test that needs a process that never imported torch runs `runpytest_subprocess` itself.

The child runs torch on one thread: GNU OpenMP is not fork-safe, and a child whose parent ran a parallel region
waits forever in its own first one with more than one thread. A run that asks for more torch threads
(`--qreport-threads`) runs as a subprocess instead, and so does every run once this process has initialized CUDA,
which a forked child cannot use."""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch

__all__ = ["HANG_SECONDS", "run_forked"]

HANG_SECONDS = 600  # a run of this suite takes seconds


def run_forked(pytester: pytest.Pytester, *args: str | os.PathLike[str],
               timeout: float | None = None) -> pytest.RunResult:
    """pytester.runpytest_subprocess(*args), run in a forked child: the same arguments, working directory,
    environment (the pytester directory first on PYTHONPATH) and result."""
    __tracebackhide__ = True
    timeout = HANG_SECONDS if timeout is None else timeout  # a child that hangs fails its test, not the suite
    if torch.cuda.is_initialized() or any(os.fspath(arg).startswith("--qreport-threads") for arg in args):
        return pytester.runpytest_subprocess(*args, timeout=timeout)
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    arguments = [f"--basetemp={basetemp}", *(os.fspath(arg) for arg in args)]
    for plugin in pytester.plugins:
        if not isinstance(plugin, str):
            raise ValueError(f"a forked pytester run takes plugins by name, not {plugin!r}")
        arguments = ["-p", plugin, *arguments]
    stdout, stderr = pytester.path / "stdout", pytester.path / "stderr"
    print("running: pytest (forked)", *arguments)
    print("     in:", Path.cwd())
    start = time.monotonic()
    with stdout.open("wb") as out, stderr.open("wb") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(arguments, out.fileno(), err.fileno())  # never returns
        status = _wait(pid, timeout, arguments)
    ret: int | pytest.ExitCode = os.waitstatus_to_exitcode(status)
    out_lines = stdout.read_text(encoding="utf8", errors="replace").splitlines()
    err_lines = stderr.read_text(encoding="utf8", errors="replace").splitlines()
    for lines, stream in ((out_lines, sys.stdout), (err_lines, sys.stderr)):
        if lines:
            print("\n".join(lines), file=stream)
    with contextlib.suppress(ValueError):
        ret = pytest.ExitCode(ret)
    return pytest.RunResult(ret, out_lines, err_lines, time.monotonic() - start)


def _child(arguments: list[str], out: int, err: int) -> None:
    """In the forked child: pytest.main(arguments) with stdout and stderr on the files, then its own exit handlers
    (not the test process's), and exit with its code."""
    code = 1
    try:
        atexit._clear()
        torch.set_num_threads(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(0, encoding="utf8", closefd=False)  # noqa: SIM115 - the child's own streams, to its end
        sys.stdout = open(1, "w", encoding="utf8", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf8", closefd=False, buffering=1)  # noqa: SIM115
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        cwd = os.getcwd()
        sys.path.insert(0, cwd)  # as the subprocess's PYTHONPATH has it
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH", "")]))
        code = int(pytest.main(arguments))
    except BaseException:  # noqa: BLE001 - reported on the child's stderr, its exit code says it failed
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float, arguments: list[str]) -> int:
    """The child's wait status; past `timeout` seconds the child is killed and Pytester.TimeoutExpired raised."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise pytest.Pytester.TimeoutExpired(f"{timeout} second timeout expired running: pytest {arguments}")
        time.sleep(0.05)
