"""qcore's optional native kernels: one C pass per batch where a chain of torch ops costs more in dispatch and
memory traffic than in arithmetic.

- `_stats.c`: the report observer's update. For a small activation (a 256x256 Linear input), a dozen separate
  torch ops cost more than the layer's matmul, torch.topk alone too. It does the whole update in one pass, with
  exact per-channel order statistics.
- `_fused.c`: the numeric suite's comparator sums, per-tensor and per-row fake quantization (of a weight as it is,
  or scaled per column as it is read, for the smoothing alpha search), and the histogram
  observer's update.
- `_formats.c`: fake quantization of the MX and NVFP4 block formats, a block at a time.

Both are compiled on first use with the system C compiler (`$CC`, default `cc`) into one library in a per-user
cache, written atomically, and loaded with ctypes. Without a compiler, or with `QCORE_NATIVE=0`, every caller
uses its torch path, which computes the same values; tests check that the two agree.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from typing import Any

__all__ = ["PARALLEL_MIN_NUMEL", "REFUSED", "STREAM_MIN_BYTES", "cache_dir", "kernel", "launch_bound", "status",
           "streams", "threads"]

_SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("_stats.c", "_fused.c", "_formats.c"))
_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
_LIBRARIES = ("-lm",)  # after the source, where linkers look for them
# Best first. -march=native puts the CPU's flags in the cache key, so a build never runs on another CPU.
_VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())
REFUSED = 2  # qcore_observe's answer when its arguments do not fit its buffers
PARALLEL_MIN_NUMEL = 1 << 15  # below this, waking a second thread costs more than it saves
# from this size a quantized weight outgrows a core's L2 cache: with more than one torch thread its lines are
# streamed to memory (see _fused.c)
STREAM_MIN_BYTES = 1 << 20
_state: dict[str, object] = {}


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cache_dir() -> pathlib.Path:
    """Where a build goes first: $QCORE_CACHE_DIR, else qcore's folder in the user cache ($XDG_CACHE_HOME, ~/.cache)."""
    return pathlib.Path(os.environ.get("QCORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "qcore"))


def _cache_dirs() -> list[pathlib.Path]:
    """Where a build may go: cache_dir(), then a per-user folder in the temp dir."""
    return [cache_dir(), pathlib.Path(tempfile.gettempdir()) / f"qcore-{_user_id()}"]


def _user_id() -> int:
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # Windows: ownership cannot be checked the POSIX way, so nothing is loaded
        raise RuntimeError("this platform has no os.getuid, so a cached kernel's owner cannot be checked")
    return getuid()


def _private(path: pathlib.Path, kind: int) -> bool:
    """True when `path` is of `kind` (not a link), owned by this user, and writable by no one else."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(info.st_mode) == kind and info.st_uid == _user_id() and not info.st_mode & 0o022


def _private_directory(path: pathlib.Path) -> bool:
    """Create `path` (mode 0700) if needed; True when it is ours alone."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return _private(path, stat.S_IFDIR)


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(target: pathlib.Path) -> bool:
    """True when `target` is ours alone and its content matches the hash recorded when it was built."""
    record = target.with_name(target.name + ".sha256")
    if not (_private(target, stat.S_IFREG) and _private(record, stat.S_IFREG)):
        return False
    try:
        return record.read_text(encoding="ascii").strip() == _digest(target)
    except (OSError, UnicodeDecodeError):
        return False


def _private_temp(directory: pathlib.Path, suffix: str) -> pathlib.Path:
    """An empty new file in `directory` that only this user may read or write (mkstemp makes it 0600)."""
    handle, path = tempfile.mkstemp(dir=directory, suffix=suffix)
    os.close(handle)
    return pathlib.Path(path)


def _compile(source: bytes, compiler: list[str], flags: tuple[str, ...]) -> pathlib.Path:
    key = repr((compiler, flags, _LIBRARIES, platform.machine(), _cpu_signature() if "-march=native" in flags else ""))
    digest = hashlib.sha256(source + key.encode()).hexdigest()[:16]
    for directory in _cache_dirs():
        if not _private_directory(directory):
            continue  # another user's folder, or one others may write: never build or load there
        target = directory / f"_kernels-{digest}.so"
        if _verified(target):
            return target
        partials: list[pathlib.Path] = []
        try:
            partials.append(_private_temp(directory, ".so.partial"))
            subprocess.run([*compiler, *flags, "-o", str(partials[0]), *map(str, _SOURCES), *_LIBRARIES], check=True,
                           capture_output=True, timeout=120)
            partials.append(_private_temp(directory, ".sha256.partial"))
            partials[1].write_text(_digest(partials[0]) + "\n", encoding="ascii")
            os.replace(partials[1], target.with_name(target.name + ".sha256"))
            os.replace(partials[0], target)  # atomic: concurrent builds (xdist workers) write the same file
        except OSError:
            continue
        finally:
            for partial in partials:
                partial.unlink(missing_ok=True)
        if _verified(target):
            return target
    raise OSError("no private cache directory for the compiled kernel (owned by this user, writable by no one else)")


def _load():
    if os.environ.get("QCORE_NATIVE", "1") == "0":
        raise RuntimeError("disabled by QCORE_NATIVE=0")
    compiler = shlex.split(os.environ.get("CC", "cc"))
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler {compiler[0] if compiler else ''!r} (set CC to one)")
    source = b"".join(path.read_bytes() for path in _SOURCES)
    failure = "no build variant compiled"
    for extra in _VARIANTS:
        try:
            built = _compile(source, compiler, _FLAGS + extra)
            break
        except subprocess.CalledProcessError as error:
            failure = error.stderr.decode(errors="replace").strip()[:300]
    else:
        raise RuntimeError(f"{compiler[0]} failed: {failure}")
    library = ctypes.CDLL(str(built))
    _state["openmp"] = "-fopenmp" in extra and _one_openmp_runtime()
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    data_and_sizes = [pointer, integer, integer, integer, integer, pointer, integer, pointer, integer]
    state_and_sizes = [pointer, integer, integer] + [pointer] * 5 + [integer, pointer, pointer, integer]
    argtypes: list[Any] = data_and_sizes + state_and_sizes
    library.qcore_observe.argtypes = argtypes
    library.qcore_observe.restype = integer
    library.qcore_scratch_floats.argtypes = [integer] * 6
    library.qcore_scratch_floats.restype = integer
    library.qcore_observe_range.argtypes = [pointer, integer, integer, pointer, pointer]
    library.qcore_observe_range.restype = integer
    library.qcore_compare_sums.argtypes = [pointer, pointer, integer, integer, pointer]
    library.qcore_compare_sums.restype = None
    library.qcore_compare_sums_by_run.argtypes = [pointer, pointer, pointer, integer, integer, integer, pointer]
    library.qcore_compare_sums_by_run.restype = None
    real = ctypes.c_float
    library.qcore_fake_quantize_per_tensor.argtypes = [pointer, pointer, integer, real, real, real, real, integer]
    library.qcore_fake_quantize_per_tensor.restype = None
    library.qcore_fake_quantize_per_row.argtypes = [pointer, pointer, integer, integer, pointer, pointer, pointer,
                                                    pointer, integer, integer]
    library.qcore_fake_quantize_per_row.restype = None
    library.qcore_fake_quantize_by_run.argtypes = [pointer, pointer, integer, integer, integer, pointer, pointer,
                                                   pointer, pointer, pointer, integer]
    library.qcore_fake_quantize_by_run.restype = integer
    library.qcore_scaled_row_extremes.argtypes = [pointer, pointer, integer, integer, integer, pointer, pointer,
                                                  integer]
    library.qcore_scaled_row_extremes.restype = None
    library.qcore_fake_quantize_scaled_rows.argtypes = [pointer, pointer, pointer, integer, integer, pointer, pointer,
                                                        pointer, pointer, integer, integer]
    library.qcore_fake_quantize_scaled_rows.restype = None
    library.qcore_fake_quantize_divided_rows.argtypes = library.qcore_fake_quantize_scaled_rows.argtypes
    library.qcore_fake_quantize_divided_rows.restype = None
    library.qcore_scale_lines.argtypes = [pointer, pointer, integer, integer, pointer, integer, integer, integer,
                                          integer]
    library.qcore_scale_lines.restype = None
    library.qcore_histogram_update.argtypes = [pointer, integer, integer, pointer, integer, pointer, pointer]
    library.qcore_histogram_update.restype = integer
    library.qcore_fake_quantize_mx.argtypes = [pointer, pointer, integer, integer, integer, integer]
    library.qcore_fake_quantize_mx.restype = None
    library.qcore_fake_quantize_nvfp4.argtypes = [pointer, pointer, integer, real, integer]
    library.qcore_fake_quantize_nvfp4.restype = None
    return library


def _one_openmp_runtime() -> bool:
    """True when torch runs on libgomp and the kernel shares that runtime (one libgomp in the process):
    then its threads are torch's own, already warm from the layer before. Two runtimes would oversubscribe."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return False
    return len(runtimes) == 1


def threads(numel: int) -> int:
    """How many threads the kernel may use for an activation of `numel` values."""
    if kernel() is None or not _state.get("openmp") or numel < PARALLEL_MIN_NUMEL:
        return 1
    import torch

    return torch.get_num_threads()


def streams(nbytes: int) -> int:
    """Whether the per-row kernels write an output of `nbytes` with streaming stores (1) or plain ones (0)."""
    import torch

    # one torch thread: the core that writes the weight is the one whose matmul reads it, and it finds it in cache
    return int(nbytes >= STREAM_MIN_BYTES and torch.get_num_threads() > 1)


def kernel():
    """The loaded kernel library, or None when it can't be built here (see `status()`)."""
    if "library" not in _state:
        try:
            _state["library"] = _load()
            _state["status"] = "native kernel" + (" (OpenMP, torch's threads)" if _state["openmp"] else "")
        except Exception as error:  # noqa: BLE001 - whatever fails here, the torch path computes the same
            _state["library"], _state["status"] = None, f"torch path only: {type(error).__name__}: {error}"
    return _state["library"]


def launch_bound(device: Any) -> bool:
    """Whether torch ops on `device` (a torch.device) run as kernel launches, each worth saving: a GPU, or the CPU
    without these kernels (the path a GPU takes, QCORE_NATIVE=0)."""
    return device.type != "cpu" or kernel() is None


def status() -> str:
    """Whether qcore uses its native kernels, and why not if it does not."""
    kernel()
    return str(_state["status"])
