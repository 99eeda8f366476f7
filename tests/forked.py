"""pytester runs in a forked child of the test process: a process of its own for each run, as `--runpytest=subprocess`
gives, without its 3 seconds of importing torch, dynamo and export again (the test process imported them: see
conftest.py). Nothing the child does reaches the test process; what the child starts with is the test process as it
is, so a test that needs a process that never imported torch runs `runpytest_subprocess` itself.

The child runs torch on one thread: GNU OpenMP is not fork-safe, and a child whose parent ran a parallel region
waits forever in its own first one with more than one thread. A run that asks for more torch threads
(`--qreport-threads`) runs as a subprocess instead, and so does every run once this process has initialized CUDA,
which a forked child cannot use.

A run under xdist (`-n N`) starts its workers the same way: the child forks a zygote before its session starts, and
each worker execnet would start as a fresh interpreter is forked from it instead (`_worker_zygote`), without the 5
seconds of imports each fresh worker spends. execnet still starts a process per worker, a small client that hands
the zygote its pipes, its working directory and its environment, and lives as long as the worker does; the worker
reads execnet's bootstrap from those pipes as a fresh interpreter would, and imports execnet anew. The runs that must
start their workers as a user's run does (test_plugin's xdist test) call `runpytest_subprocess`."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

__all__ = ["HANG_SECONDS", "run_forked", "run_forked_in"]

HANG_SECONDS = 600  # a run of this suite takes seconds


def run_forked(pytester: pytest.Pytester, *args: str | os.PathLike[str],
               timeout: float | None = None) -> pytest.RunResult:
    """pytester.runpytest_subprocess(*args), run in a forked child: the same arguments, working directory,
    environment (the pytester directory first on PYTHONPATH) and result."""
    __tracebackhide__ = True
    timeout = HANG_SECONDS if timeout is None else timeout  # a child that hangs fails its test, not the suite
    if torch.cuda.is_initialized() or any(os.fspath(arg).startswith("--qreport-threads") for arg in args):
        return pytester.runpytest_subprocess(*args, timeout=timeout)
    for plugin in pytester.plugins:
        if not isinstance(plugin, str):
            raise ValueError(f"a forked pytester run takes plugins by name, not {plugin!r}")
    plugins = [part for plugin in pytester.plugins for part in ("-p", plugin)]
    return _run_in_child(pytester.path, [*plugins, *(os.fspath(arg) for arg in args)], timeout)


def run_forked_in(folder: Path, *args: str, environment: dict[str, str], timeout: float = HANG_SECONDS
                  ) -> pytest.RunResult:
    """`pytest *args` run in `folder` in a forked child, with `environment` added to its environment: for a run
    that tests share, which no test's pytester can make."""
    previous_cwd, previous_environment = os.getcwd(), dict(os.environ)
    os.chdir(folder)
    os.environ.update(environment)
    try:
        return _run_in_child(Path(folder), list(args), timeout)
    finally:
        os.chdir(previous_cwd)
        os.environ.clear()
        os.environ.update(previous_environment)


def _run_in_child(path: Path, arguments: list[str], timeout: float) -> pytest.RunResult:
    """pytest.main(arguments) in a forked child whose working directory is this process's, its output kept under
    `path`; the run's result as pytester gives it."""
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=path)
    arguments = [f"--basetemp={basetemp}", *arguments]
    stdout, stderr = path / "stdout", path / "stderr"
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
        _streams_on_standard_descriptors()
        cwd = os.getcwd()
        sys.path.insert(0, cwd)  # as the subprocess's PYTHONPATH has it
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH", "")]))
        with _worker_zygote(arguments):
            code = int(pytest.main(arguments))
    except BaseException:  # noqa: BLE001 - reported on the child's stderr, its exit code says it failed
        traceback.print_exc()
    finally:
        _exit_handlers_then_exit(code)


def _streams_on_standard_descriptors() -> None:
    """sys's streams anew on descriptors 0, 1 and 2 (a forked process's own, once the caller has put them there)."""
    sys.stdin = open(0, encoding="utf8", closefd=False)  # noqa: SIM115 - the process's own streams, to its end
    sys.stdout = open(1, "w", encoding="utf8", closefd=False, buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf8", closefd=False, buffering=1)  # noqa: SIM115
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def _exit_handlers_then_exit(code: int, connection: socket.socket | None = None) -> None:
    """Run this process's own exit handlers, flush its streams, tell `connection` the code, and exit with it."""
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    if connection is not None:
        with contextlib.suppress(OSError):
            connection.sendall(str(code).encode())
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


# the client execnet starts for a worker: it hands the zygote its pipes (stdin, stdout, stderr), working directory and
# environment, closes its own copies, and waits for the worker's process to end: the worker holds the connection
_CLIENT = """import json, os, socket, sys
connection = socket.socket(socket.AF_UNIX)
connection.connect(sys.argv[1])
socket.send_fds(connection, [json.dumps([os.getcwd(), dict(os.environ)]).encode()], [0, 1, 2])
for fd in (0, 1):
    os.close(fd)
code = connection.recv(16) or b"1"
while connection.recv(16):  # the connection closes when the worker's process has ended
    pass
sys.exit(int(code))
"""


@contextlib.contextmanager
def _worker_zygote(arguments: list[str]) -> Iterator[None]:
    """For a run whose arguments ask for xdist: a zygote forked now, which forks each worker execnet asks for (see
    the module's docstring), until the run ends; nothing for any other run."""
    if not any(arg == "-n" or arg.startswith(("-n", "--numprocesses", "--tx")) for arg in arguments):
        yield
        return
    import execnet.gateway_io

    folder = tempfile.gettempdir() if len(tempfile.gettempdir()) < 80 else "/tmp"  # a socket's path is short
    path = tempfile.mktemp(prefix="zygote-", suffix=".sock", dir=folder)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    pid = os.fork()
    if pid == 0:
        _serve_workers(listener)  # never returns
    listener.close()
    original = execnet.gateway_io.popen_args
    execnet.gateway_io.popen_args = lambda spec: (
        original(spec) if spec.python else [sys.executable, "-S", "-c", _CLIENT, path])
    try:
        yield
    finally:
        execnet.gateway_io.popen_args = original
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.unlink(path)


def _serve_workers(listener: socket.socket) -> None:
    """In the zygote: fork a worker for each client that connects, until the session's process ends."""
    parent = os.getppid()
    listener.settimeout(0.5)
    while os.getppid() == parent:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        connection.settimeout(None)
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        middle = os.fork()
        if middle == 0:  # forks the worker and exits: the worker is nobody's child here to reap
            listener.close()
            if os.fork() == 0:
                _worker(connection, fds, *json.loads(message))  # never returns
            os._exit(0)
        os.waitpid(middle, 0)
        connection.close()
        for fd in fds:
            os.close(fd)
    os._exit(0)


def _worker(connection: socket.socket, fds: list[int], cwd: str, environment: dict[str, str]) -> None:
    """In a forked worker: the streams and place of the client that asked for it, then execnet's bootstrap as
    `python -c "import sys;exec(eval(sys.stdin.readline()))"` runs it; tells the client its exit code."""
    code = 1
    try:
        atexit._clear()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _streams_on_standard_descriptors()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environment)
        for name in [name for name in sys.modules if name == "execnet" or name.startswith("execnet.")]:
            del sys.modules[name]  # the session's gateways live there; the worker's are its own
        exec(eval(sys.stdin.readline()), {"__name__": "__main__"})  # noqa: S307 - execnet's bootstrap, as python -c
        code = 0
    except SystemExit as exit_:
        code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the worker's stderr, its exit code says it failed
        traceback.print_exc()
    finally:
        _exit_handlers_then_exit(code, connection)
