"""How many threads a call uses, and keeping BLAS single-threaded underneath them.

ltx2blas parallelises over output tiles with OpenMP and calls sgemm from every thread, so the
BLAS must not start threads of its own (threads would multiply, and some BLAS builds split the
depth differently per thread count, which would break exactness).  While any ltx2blas call is
running, BLAS is limited to one thread; the caller's setting is restored when the last
concurrent call returns.
"""
import math
import operator
import os
import threading
import time
from contextlib import contextmanager

from . import _gemm
from .errors import ArgumentError, ArgumentTypeError


def _cgroup_cpus():
    """CPUs granted by a cgroup quota (containers), or None when unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        if quota > 0 and period > 0:
            return max(1, math.ceil(quota / period))
    except (OSError, ValueError):
        pass
    return None


#: Seconds a cgroup quota read is reused: reading it opens one or two files (tens of
#: microseconds, a serial step of every call with threads=None), and a quota changes rarely.
QUOTA_TTL = 1.0
_quota_read = (None, -math.inf)


def _cgroup_cpus_recent():
    """_cgroup_cpus(), read again when the last read is more than QUOTA_TTL seconds old."""
    global _quota_read
    value, when = _quota_read
    now = time.monotonic()
    if now - when > QUOTA_TTL:
        value = _cgroup_cpus()
        _quota_read = (value, now)
    return value


def available_cpus():
    """CPUs this process may run on: affinity mask, capped by a cgroup quota (re-read at most
    once every QUOTA_TTL seconds)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpus_recent()
    return min(cpus, quota) if quota else cpus


def default_threads():
    """threads=None: every CPU the process may use, capped by OMP_NUM_THREADS and by an OpenMP
    limit set through threadpoolctl (both show in omp_get_max_threads)."""
    if not _gemm.have_openmp():
        return 1
    return max(1, min(available_cpus(), _gemm.omp_max_threads()))


#: The most threads a call may be asked for: far above any machine's CPU count, and within
#: the C int that OpenMP and the BLAS take.
MAX_THREADS = 1 << 16


def resolve_threads(threads):
    """The thread count a call runs with: None means default_threads(); an int is used as
    given (values above the CPU count are allowed, for benchmarking oversubscription), up to
    MAX_THREADS."""
    if threads is None:
        return default_threads()
    if isinstance(threads, bool):
        raise ArgumentTypeError(f"threads must be None or a positive int, got {threads!r}")
    try:
        threads = operator.index(threads)
    except TypeError:
        raise ArgumentTypeError(f"threads must be None or a positive int, got {threads!r}") from None
    if not 1 <= threads <= MAX_THREADS:
        raise ArgumentError(f"threads must be between 1 and {MAX_THREADS}, got {threads}")
    return threads if _gemm.have_openmp() else 1


_lock = threading.Lock()
_active = 0
_limiter = None
_controller = None


def _blas_controller():
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller


def scipy_blas():
    """threadpoolctl's record of the BLAS that scipy.linalg.cython_blas calls (scipy's own, when
    bundled), or None: read now, so that its thread count is the current one."""
    libraries = [lib for lib in _blas_controller().info() if lib.get("user_api") == "blas"]
    return next((lib for lib in libraries if "scipy" in os.path.basename(
        os.path.dirname(lib.get("filepath", ""))) or "scipy.libs" in lib.get("filepath", "")),
        libraries[-1] if libraries else None)


def _free_openblas_control():
    """threadpoolctl >= 3.8 lets only one Python thread at a time change a pthreads OpenBLAS's
    thread count (the first to try) and silently ignores the others; the thread that pins BLAS
    for ltx2blas and the one that restores it can differ, so release that claim around both."""
    from threadpoolctl import OpenBLASController

    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


@contextmanager
def blas_single_threaded():
    """Limit every BLAS library in the process to one thread for the duration (reference
    counted across Python threads: the original limits come back when the last one leaves)."""
    global _active, _limiter
    with _lock:
        if _active == 0:
            _free_openblas_control()
            _limiter = _blas_controller().limit(limits=1, user_api="blas")
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                _free_openblas_control()
                _limiter.restore_original_limits()
                _limiter = None
                _free_openblas_control()


#: At most this many waves a call's tasks run in: progress is reported, and an interrupt or an
#: exception from the progress callback taken, between waves.
WAVES = 16
#: At least this many tasks a thread a wave: a wave ends when its last task does, so with
#: cores of unequal speed (a big.LITTLE machine, more threads than cores) the threads that
#: finish first wait for up to one task of the slowest; in waves of 32 rounds that wait is a
#: few percent of the wave (3 threads on 2 cores: text_features of 64 tokens kept 0.71 of the
#: 2-thread throughput in 16 waves of 2 rounds, 0.95 in one wave).
MIN_ROUNDS = 32


def waves(tasks, threads):
    """(first, stop) of each wave of a call's ``tasks``: whole rounds of ``threads`` tasks, so
    that no thread waits at a wave's end for a round it has no task in (5 tasks on 2 threads
    would leave one idle a sixth of the time), at least :data:`MIN_ROUNDS` rounds a wave and
    at most :data:`WAVES` waves."""
    size = threads * max(MIN_ROUNDS, -(-tasks // (WAVES * threads)))
    return [(first, min(tasks, first + size)) for first in range(0, tasks, size)]
