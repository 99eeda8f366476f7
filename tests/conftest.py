"""Shared test helpers."""
import os
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401
import torch.export  # noqa: F401

# Modules that register torch operator libraries (dynamo imports torch._inductor.test_operators) are imported
# here, once per process: a pytester test removes from sys.modules what it imported, and a second import of such
# a module would register its library again and fail. A first export imports more of them (the compile caches
# register their artifact types), so one tiny export runs here too.
torch.export.export(torch.nn.Linear(1, 1), (torch.zeros(1, 1),))
# transformers imports HQQ where it is installed (cache_utils), and HQQ compiles a function at import, which
# imports dynamo's debugging backends (they register "eager" once per process). Imported here, once per process,
# transformers and what it imports stay imported across pytester's runs, which drop what a run imported (about 10 s
# to import again with HQQ installed)
import torch._dynamo.backends.debugging  # noqa: E402, F401
import torch._dynamo.repro.after_dynamo  # noqa: E402, F401
import transformers.cache_utils  # noqa: E402, F401
import transformers.models.llama.modeling_llama  # noqa: E402, F401

from qcore.runtime import native  # noqa: E402


def _quanto_unpack(packed, bits):
    """quanto's own Python unpack kernel (optimum/quanto/library/unpack.py): `bits`-bit values out of uint8 bytes."""
    return torch.cat([(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]).to(torch.uint8)


# quanto compiles its C++ unpack kernel for the CPU on the first int4 weight it unpacks: a minute of one of CI's two
# cores on every fresh environment. Its Python kernel gives the same bytes, and the tests' quanto artifacts use it.
import optimum.quanto  # noqa: E402, F401

_QUANTO_CPU = torch.library.Library("quanto", "IMPL")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # "Overriding a previously registered kernel"
    _QUANTO_CPU.impl("unpack", _quanto_unpack, "CPU", allow_override=True)

if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("OMP_NUM_THREADS"):
    # one share of the cores per xdist worker: oversubscribed OpenMP threads slow everything down
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.ao")
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def forbid_host_sync(monkeypatch):
    """Make Tensor.item()/.cpu()/.tolist() raise, to prove a code path never copies to the host."""

    def refuse(*args, **kwargs):
        raise AssertionError("host copy on a streaming path")

    for name in ("item", "cpu", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    yield


# qcore's native kernels, compiled once into the user's cache: pytester points HOME at each test's own folder, where
# each run's fresh interpreters (its xdist workers, a subprocess run) would compile them again, seconds each
NATIVE_CACHE = str(native.cache_dir())


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester whose runpytest runs in a forked child of this process (tests/forked.py). Its runs leave out the
    plugins of hypothesis and anyio, which no project of theirs uses: importing them costs each fresh interpreter
    (a subprocess run, each xdist worker) about a second; and they build qcore's native kernels in the session's
    cache, not in the test's folder."""
    from tests.forked import run_forked

    monkeypatch.setenv("PYTEST_ADDOPTS", f"{os.environ.get('PYTEST_ADDOPTS', '')} -p no:hypothesispytest -p no:anyio")
    monkeypatch.setenv("QCORE_CACHE_DIR", NATIVE_CACHE)
    monkeypatch.setattr(pytester, "runpytest", lambda *args, **kwargs: run_forked(pytester, *args, **kwargs))
    return pytester
