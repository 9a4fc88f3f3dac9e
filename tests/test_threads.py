"""Threads: the same bytes for any count, BLAS kept single-threaded underneath and its limits
restored, safe from several Python threads at once."""
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import ltx2blas
from ltx2blas import _threads, reference

from helpers import random_bf16


def blas_threads():
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_blas_limits_are_restored(rng):
    weight = random_bf16(rng, (64, 64), 0.02)
    lora_a, lora_b = random_bf16(rng, (8, 64)), random_bf16(rng, (64, 8))
    before = blas_threads()
    ltx2blas.fuse_lora(weight, lora_a, lora_b, threads=2)
    assert blas_threads() == before


def test_blas_is_single_threaded_during_a_call():
    with _threads.blas_single_threaded():
        assert set(blas_threads()) == {1}
        with _threads.blas_single_threaded():
            assert set(blas_threads()) == {1}
        assert set(blas_threads()) == {1}


def test_blas_is_pinned_and_restored_from_any_python_thread(rng):
    """A call from a worker thread, after one from the main thread, must still pin BLAS to one
    thread (threadpoolctl >= 3.8 ignores limits set from a second Python thread unless the
    first releases its claim) and restore it afterwards."""
    x = rng.standard_normal((40, 500), dtype=np.float32)
    w = rng.standard_normal((100, 500), dtype=np.float32)
    before = blas_threads()
    seen = {}

    def call(name):
        ltx2blas.linear(x, w, threads=1, progress=lambda f: seen.setdefault(name, blas_threads()))

    call("main")
    worker = threading.Thread(target=call, args=("worker",))
    worker.start()
    worker.join()
    call("main again")
    assert set(seen["main"]) == set(seen["worker"]) == set(seen["main again"]) == {1}
    assert blas_threads() == before


def test_under_caller_limits(rng):
    weight = random_bf16(rng, (70, 90), 0.02)
    lora_a, lora_b = random_bf16(rng, (450, 90), 0.01), random_bf16(rng, (70, 450), 0.01)
    expected = reference.fuse_lora(weight, lora_a, lora_b, 0.3)
    with threadpool_limits(limits=1):
        assert ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.3).tolist() == expected.tolist()
        assert set(blas_threads()) == {1}
    with threadpool_limits(limits=1, user_api="blas"):
        got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.3, threads=3)
        assert set(blas_threads()) == {1}
    assert np.array_equal(got, expected)


def test_eight_python_threads_at_once(rng):
    weight = random_bf16(rng, (150, 260), 0.02)
    adapters = [(random_bf16(rng, (r, 260), 0.01), random_bf16(rng, (150, r), 0.01))
                for r in (16, 450, 520, 64)]
    expected = [reference.fuse_lora(weight, a, b, 0.8) for a, b in adapters]
    before = blas_threads()
    results = [None] * 8
    errors = []
    barrier = threading.Barrier(8)

    def work(i):
        try:
            a, b = adapters[i % 4]
            barrier.wait()
            for _ in range(3):
                results[i] = ltx2blas.fuse_lora(weight, a, b, 0.8, threads=2, tile=(32, 64))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    for i in range(8):
        assert np.array_equal(results[i], expected[i % 4])
    assert blas_threads() == before


def test_default_threads_respects_available_cpus():
    assert 1 <= _threads.default_threads() <= _threads.available_cpus()
    assert _threads.resolve_threads(None) == _threads.default_threads()
    assert _threads.resolve_threads(5) == 5 or not ltx2blas._gemm.have_openmp()


@pytest.mark.parametrize("quota, expected", [("max 100000", None), ("150000 100000", 2),
                                             ("50000 100000", 1)])
def test_cgroup_quota(monkeypatch, tmp_path, quota, expected):
    import builtins

    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/sys/fs/cgroup/cpu.max":
            f = tmp_path / "cpu.max"
            f.write_text(quota)
            return real_open(f, *args, **kwargs)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert _threads._cgroup_cpus() == expected


def test_omp_num_threads_sets_the_default():
    import subprocess
    import sys

    code = "from ltx2blas import _threads; print(_threads.default_threads())"
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.strip() == "1"


def test_threadpool_limits_on_openmp_set_the_default():
    if not ltx2blas._gemm.have_openmp():
        pytest.skip("built without OpenMP")
    with threadpool_limits(limits=1):
        assert _threads.default_threads() == 1


# The fuse shapes of LTX-2's transformer (attention 4096 x 4096, feed-forward 4096 x 16384 and
# back, and the audio stream's 2048-wide layers).
LTX2_FUSE_SHAPES = [(2048, 2048), (4096, 4096), (4096, 16384), (16384, 4096), (2048, 4096),
                    (4096, 2048)]


@pytest.fixture
def tiles_run(monkeypatch):
    """Records the tile shape of every fuse the driver runs."""
    from ltx2blas import fuse

    seen = []

    class Recording(fuse._fuse.FusePlan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.tiles)

    monkeypatch.setattr(fuse._fuse, "FusePlan", Recording)
    return seen


@pytest.mark.parametrize("shape", LTX2_FUSE_SHAPES)
def test_every_ltx2_shape_is_cut_into_256_tasks_with_the_same_bytes(rng, shape, tiles_run):
    """Machines with tens of cores need many independent tiles; the bytes must not depend on
    how many there are."""
    weight = random_bf16(rng, shape, 0.02)
    lora_a, lora_b = random_bf16(rng, (4, shape[1]), 0.02), random_bf16(rng, (shape[0], 4), 0.02)
    fused = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=2)
    assert tiles_run[-1] >= 256
    for tile in (ltx2blas.fuse.DEFAULT_TILE, (64, 64)):
        other = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=2, tile=tile)
        assert other.view(np.uint16).tobytes() == fused.view(np.uint16).tobytes()


@pytest.mark.parametrize("rank", [32, 384])
def test_smaller_default_tiles_leave_the_bytes_of_every_route(rng, rank, tiles_run):
    shape = (2048, 2048)
    weight = random_bf16(rng, shape, 0.02)
    lora_a = random_bf16(rng, (rank, shape[1]), 0.02)
    lora_b = random_bf16(rng, (shape[0], rank), 0.02)
    fused = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=2)
    assert tiles_run[-1] == 256  # 128 x 128 tiles
    other = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=1,
                               tile=ltx2blas.fuse.DEFAULT_TILE)
    assert other.view(np.uint16).tobytes() == fused.view(np.uint16).tobytes()
    rows = rng.choice(shape[0], 4, replace=False)
    expected = reference.fuse_lora(weight[rows], lora_a, lora_b[rows], 0.8)
    assert fused[rows].view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


def test_default_tile_rule():
    from ltx2blas.fuse import default_tile

    assert default_tile(2048, 2048) == (128, 128)
    assert default_tile(4096, 4096) == (256, 256)
    assert default_tile(4096, 16384) == (512, 256)
    assert default_tile(2048, 4096) == (128, 256)
    assert default_tile(8, 8) == (64, 64)  # no smaller than SMALLEST_TILE


@pytest.mark.parametrize("tasks, threads", [(1, 1), (5, 2), (256, 3), (11, 2), (4000, 20),
                                            (100_000, 7)])
def test_waves_are_whole_rounds_of_many_tasks(tasks, threads):
    """Waves of whole rounds of the thread count, each of at least MIN_ROUNDS rounds (so that
    cores of unequal speed wait for one task at most at a wave's end, a few percent), at most
    WAVES of them, covering every task once in order."""
    from ltx2blas._threads import MIN_ROUNDS, WAVES, waves
    got = waves(tasks, threads)
    assert got[0][0] == 0 and got[-1][1] == tasks and len(got) <= WAVES
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    for first, stop in got[:-1]:
        assert (stop - first) % threads == 0 and stop - first >= MIN_ROUNDS * threads
