"""A bf16 fuse whose result overflows to +-inf from a finite weight element: counted by every
kernel table's rounding store (against an independent count from the reference loop), returned
by the array API, refused by the file layer unless allowed, and named on the command line."""
import subprocess
import sys

import numpy as np
import pytest

import _ltx2blas_hooks as hooks
import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.fuse import LoHa, LoKr

import ckpt_helpers as ck

BF16_MAX = 0x7F7F
# the reference loop overflows on purpose here
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value")


def overflowed(result, weight):
    """The independent count: the reference's results that are +-inf where the weight's
    element is finite, and the first's flat index (-1 for none)."""
    result, weight = np.asarray(result).reshape(-1), np.asarray(weight).reshape(-1)
    hits = np.flatnonzero(((result & 0x7FFF) == 0x7F80) & ((weight & 0x7F80) != 0x7F80))
    return hits.size, int(hits[0]) if hits.size else -1


def near_max(rng, shape, share=0.3):
    """bf16 bits: ordinary values, and a share of them within a factor of 2 of bf16's largest,
    of either sign; a few +-inf and a NaN, which are not overflows whatever is added."""
    w = (rng.integers(0x3C00, 0x3F80, shape) | (rng.integers(0, 2, shape) << 15)).astype(np.uint16)
    big = rng.random(shape) < share
    w[big] = (rng.integers(0x7F00, BF16_MAX + 1, big.sum())
              | (rng.integers(0, 2, big.sum()) << 15)).astype(np.uint16)
    flat = w.reshape(-1)
    flat[rng.choice(flat.size, 3, replace=False)] = [0x7F80, 0xFF80, 0x7FC1]
    return w


def big_pair(rng, rank, rows, cols, scale=2.0**125):
    """A LoRA pair whose products reach about 2**126 (each below 2**127, so the fast tables
    take it): A of magnitude 1 to 2, B of magnitude about ``scale``, signs mixed."""
    a = (rng.integers(0x3F80, 0x4000, (rank, cols)) | (rng.integers(0, 2, (rank, cols)) << 15))
    e = 0x3F80 + (int(np.log2(scale)) << 7)
    b = (rng.integers(e, e + 0x80, (rows, rank)) | (rng.integers(0, 2, (rows, rank)) << 15))
    return a.astype(np.uint16), b.astype(np.uint16)


# ---- the stores of every kernel table ----------------------------------------------------


@pytest.mark.parametrize("cols", [1, 15, 37, 64, 100])
def test_store_fused_counts_overflows(kernel_table, rng, cols):
    rows = 7
    w = near_max(rng, (rows, cols + 3))
    acc = (rng.standard_normal((rows, cols)) * 2.0**127).astype(np.float32)
    acc.reshape(-1)[rng.choice(rows * cols, min(3, rows * cols), replace=False)] = [
        np.inf, -np.inf, np.nan][:min(3, rows * cols)]
    out, count, first = hooks.store_fused_tile(acc, w, kernel_table, counted=True)
    expected = reference.bf16_round(reference.bf16_widen(w[:, :cols]) +
                                    reference.bf16_widen(reference.bf16_round(acc)))
    assert np.array_equal(out[:, :cols], expected)
    n, at = overflowed(expected, w[:, :cols])
    assert n > 0 and count == n
    assert first == (-1 if at < 0 else at // cols * (cols + 3) + at % cols)  # r * ldw + i


def test_store_fused_counts_nothing_in_range(kernel_table, rng):
    w = (rng.integers(0x3C00, 0x3F80, (9, 70))).astype(np.uint16)
    acc = rng.standard_normal((9, 70)).astype(np.float32)
    w[0, 0] = 0x7F80  # an inf weight stays inf: not an overflow
    _, count, first = hooks.store_fused_tile(acc, w, kernel_table, counted=True)
    assert (count, first) == (0, -1)


@pytest.mark.parametrize("m, n, k", [(5, 33, 3), (13, 70, 8), (8, 16, 1)])
def test_one_pass_fuse_counts_overflows(kernel_table, rng, m, n, k):
    w = near_max(rng, (m, n))
    a, b = big_pair(rng, k, m, n, scale=2.0**124)
    x = reference.bf16_widen(b)
    y = reference.bf16_widen(a)
    out, count, first = hooks.seq_fuse_bf16(x, y, w, kernel_table, counted=True)
    expected = reference.bf16_round(reference.bf16_widen(w) + reference.bf16_widen(
        reference.bf16_round(reference.lora_product(a, b))))
    assert np.array_equal(out, expected)
    assert (count, first) == overflowed(expected, w)


def test_dot_product_fuse_counts_overflows(pairs_table, rng):
    m, n, k = 13, 70, 8
    w = near_max(rng, (m, n))
    a, b = big_pair(rng, k, m, n, scale=2.0**120)
    w[w.view(np.int16) < 0] &= 0x7FFF  # positive, as the sums: no cancellation needed
    out, count, first = hooks.dot_fuse_bf16(b, a, w, pairs_table, counted=True)
    expected = reference.bf16_round(reference.bf16_widen(w) + reference.bf16_widen(
        reference.bf16_round(reference.lora_product(a, b))))
    assert np.array_equal(out, expected)
    assert (count, first) == overflowed(expected, w)


# ---- the array API: every route, rule and kind, every table, 1 to 3 threads --------------

ROWS, COLS = 150, 200


def _cases(rng):
    """(name, adapters, rule) whose results overflow in places, on a near_max weight."""
    a1, b1 = big_pair(rng, 4, ROWS, COLS)
    a2, b2 = big_pair(rng, 3, ROWS, COLS)
    diff = near_max(rng, (ROWS, COLS), share=0.5)
    diff.reshape(-1)[:3] = 0  # no inf in the adapter
    w1 = (rng.integers(0x3F80, 0x4000, (10, 8)) | (rng.integers(0, 2, (10, 8)) << 15)).astype(np.uint16)
    w2 = (rng.integers(0x7E00, 0x7E80, (15, 25)) | (rng.integers(0, 2, (15, 25)) << 15)).astype(np.uint16)
    ha, hb = big_pair(rng, 2, ROWS, COLS, scale=2.0**62)
    hc, hd = big_pair(rng, 2, ROWS, COLS, scale=2.0**62)
    return [
        ("lora", [(a1, b1, 1.0)], "addmm"),
        ("lora 1e20", [(np.full((2, COLS), 0x60AD, np.uint16), np.full((ROWS, 2), 0x60AD, np.uint16), 1.0)],
         "addmm"),
        ("sum", [(a1, b1, 0.75), (a2, b2, 1.0)], "sum"),
        ("addmm", [(a1, b1, 0.75), (a2, b2, 0.5)], "addmm"),
        ("diff", [(diff, 1.5)], "addmm"),
        ("lokr", [LoKr(w1, w2, 2.0)], "addmm"),
        ("loha", [LoHa(hb, ha, hd, hc, 1.0)], "addmm"),
        ("lokr+diff sum", [LoKr(w1, w2, 1.0), (diff, 1.0)], "sum"),
    ]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fuse_counts_overflows_like_the_reference(kernel_table, threads):
    rng = np.random.default_rng(7)
    w = near_max(rng, (ROWS, COLS))
    for name, adapters, rule in _cases(rng):
        expected = reference.fuse_loras(w, adapters, rule)
        n, at = overflowed(expected, w)
        assert n > 0, name
        got, count = ltx2blas.fuse_loras(w, adapters, rule=rule, threads=threads, tile=(64, 48),
                                         return_overflows=True)
        assert np.array_equal(got, expected), name
        assert count == n, name
        assert count.first == tuple(int(v) for v in np.unravel_index(at, w.shape)), name


def test_fuse_lora_returns_the_count_and_first_position(rng):
    w = np.zeros((64, 40), np.uint16)
    w[5, 7] = 0x7F7F  # bf16's largest: + 2**120 rounds to inf
    a, b = np.full((1, 40), 0x3F80, np.uint16), np.full((64, 1), 0x7B80, np.uint16)
    got, count = ltx2blas.fuse_lora(w, a, b, return_overflows=True)
    assert (int(count), count.first) == (1, (5, 7)) and got[5, 7] == 0x7F80
    _, none = ltx2blas.fuse_lora(w, a, b, 0.0, return_overflows=True)
    assert (int(none), none.first) == (0, None)


def test_the_1e20_lora_overflows_every_element(rng):
    """The finding: factors of 1e20 make every element of a finite weight inf."""
    w = (rng.integers(0x3C00, 0x3F80, (256, 128))).astype(np.uint16)
    a, b = np.full((2, 128), 0x60AD, np.uint16), np.full((256, 2), 0x60AD, np.uint16)
    got, count = ltx2blas.fuse_lora(w, a, b, return_overflows=True)
    assert np.all(got == 0x7F80) and (int(count), count.first) == (w.size, (0, 0))


@pytest.mark.parametrize("in_place", [True, False])
def test_allow_overflow_false_refuses_before_writing(rng, in_place):
    w = near_max(rng, (ROWS, COLS))
    a, b = big_pair(rng, 4, ROWS, COLS)
    n, at = overflowed(reference.fuse_lora(w, a, b, 1.0), w)
    target = w.copy()
    out = target if in_place else np.full_like(w, 0x1234)
    before = out.copy()
    r, c = np.unravel_index(at, w.shape)
    with pytest.raises(errors.NonFiniteResultError,
                       match=rf"overflows bf16 at \({r}, {c}\): {n} values became \+-inf"):
        ltx2blas.fuse_lora(target, a, b, out=out, allow_overflow=False, threads=2)
    assert np.array_equal(out, before)
    # where nothing overflows, the same call fuses
    small = (rng.integers(0x3C00, 0x3F80, (ROWS, COLS))).astype(np.uint16)
    assert np.array_equal(ltx2blas.fuse_lora(small, a, b, 2.0**-100, allow_overflow=False),
                          reference.fuse_lora(small, a, b, 2.0**-100))


# ---- the file layer and the command line --------------------------------------------------

M = "model.diffusion_model."
Q = "transformer_blocks.0.attn1.to_q"


@pytest.fixture
def overflow_files(tmp_path, rng):
    """A bf16 checkpoint and an adapter on to_q whose fuse overflows in places (to_q's weight
    holds values near bf16's largest), with the reference's result, count and first."""
    model = ck.model(rng)
    name = M + Q + ".weight"
    shape = model[name][1].shape
    w = model[name][1]
    w[1::3, ::5] = BF16_MAX
    a, b = big_pair(rng, 4, *shape, scale=2.0**124)
    ad = {"diffusion_model." + Q + ".lora_A.weight": ("BF16", a),
          "diffusion_model." + Q + ".lora_B.weight": ("BF16", b)}
    expected = reference.fuse_lora(w, a, b, 1.0)
    n, at = overflowed(expected, w)
    assert 0 < n < w.size
    return (ck.write(tmp_path / "model.safetensors", model), ck.write(tmp_path / "a.safetensors", ad),
            model, name, expected, n, tuple(int(v) for v in np.unravel_index(at, shape)))


def test_checkpoint_overflow_refused_by_default(overflow_files, tmp_path):
    mp, ap, _, name, _, n, first = overflow_files
    out = tmp_path / "out.safetensors"
    with pytest.raises(errors.NonFiniteResultError) as info:
        ltx2blas.fuse_checkpoint(mp, [(ap, 1.0)], out)
    message = str(info.value)
    assert f"{name}: the fused weight overflows bf16 at {first}: {n} values" in message
    assert str(mp) in message and "allow_overflow=True" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "model.safetensors"]


def test_checkpoint_overflow_allowed_is_counted_and_verifies(overflow_files, tmp_path):
    mp, ap, _, name, expected, n, first = overflow_files
    out = tmp_path / "out.safetensors"
    report = ltx2blas.fuse_checkpoint(mp, [(ap, 1.0)], out, allow_overflow=True)
    from ltx2blas.files.safetensors import SafetensorsFile
    with SafetensorsFile(out) as f:
        assert np.array_equal(f.read(name), expected)
    assert report.bf16_overflows == {name: (n, first)} and report.fp8_overflows == {}
    assert (f"{n} bf16 values in 1 weight overflowed to +-inf from finite weight elements (e.g. "
            f"{n} in {name}, first at {first}), stored as +-inf (allow_overflow=True)"
            in report.summary())
    assert ltx2blas.verify_checkpoint(out).status == "verified"


def test_state_dict_overflow_refused_untouched_or_allowed(overflow_files):
    _, ap, model, name, expected, n, first = overflow_files
    state = {k: v.copy() for k, (_, v) in model.items()}
    with pytest.raises(errors.NonFiniteResultError, match=rf"<state dict>: {name}: .* at "
                                                          rf"\({first[0]}, {first[1]}\)"):
        ltx2blas.fuse_state_dict(state, [(ap, 1.0)])
    assert np.array_equal(state[name], model[name][1])  # left as it was
    report = ltx2blas.fuse_state_dict(state, [(ap, 1.0)], allow_overflow=True)
    assert np.array_equal(state[name], expected) and report.bf16_overflows == {name: (n, first)}


def run(*args):
    return subprocess.run([sys.executable, "-m", "ltx2blas", *map(str, args)],
                          capture_output=True, text=True, cwd="/", timeout=300)


def test_command_line_refuses_then_allows(overflow_files, tmp_path):
    mp, ap, _, name, _, n, first = overflow_files
    out = tmp_path / "out.safetensors"
    r = run("fuse", mp, "--lora", f"{ap}:1.0", "-o", out, "-q")
    assert r.returncode == 5, r.stderr
    assert f"{name}: the fused weight overflows bf16 at {first}: {n} values" in r.stderr
    assert "--allow-overflow" in r.stderr and "allow_overflow=True" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    r = run("fuse", mp, "--lora", f"{ap}:1.0", "-o", out, "-q", "--allow-overflow")
    assert r.returncode == 0, r.stderr
    assert f"{n} bf16 values in 1 weight overflowed to +-inf" in r.stdout and out.exists()
    r = run("verify", out)
    assert r.returncode == 0 and "verified" in r.stdout
