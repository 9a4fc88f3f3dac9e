"""Property tests (hypothesis): random shapes, ranks, strengths, thread counts and dtypes for the
fuse and the Linear against the reference, and random safetensors files round-tripping both
ways with the reference package."""
import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ltx2blas  # noqa: E402
from ltx2blas import reference  # noqa: E402
from ltx2blas.linear_layer import gamma  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def bf16_array(seed, shape, scale):
    rng = np.random.default_rng(seed)
    return reference.bf16_round(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))


@SETTINGS
@given(rows=st.integers(1, 70), cols=st.integers(1, 90),
       ranks=st.lists(st.one_of(st.integers(0, 40), st.integers(380, 620)), min_size=1, max_size=3),
       strengths=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=3, max_size=3),
       threads=st.integers(1, 4), tile=st.sampled_from([None, (7, 16), (32, 8), (64, 64)]),
       ml_kind=st.booleans(), seed=st.integers(0, 2**31))
def test_fuse_matches_reference(rows, cols, ranks, strengths, threads, tile, ml_kind, seed):
    weight = bf16_array(seed, (rows, cols), 0.05)
    adapters = [(bf16_array(seed + 1 + i, (r, cols), 0.05), bf16_array(seed + 11 + i, (rows, r), 0.05),
                 float(s)) for i, (r, s) in enumerate(zip(ranks, strengths))]
    if ml_kind:
        import ml_dtypes

        weight = weight.view(ml_dtypes.bfloat16)
    if len(adapters) == 1:
        got = ltx2blas.fuse_lora(weight, *adapters[0], threads=threads, tile=tile)
        expected = (weight.view(np.uint16) if adapters[0][0].shape[0] == 0 else
                    reference.fuse_lora(weight.view(np.uint16), *adapters[0]))
    else:
        got = ltx2blas.fuse_loras(weight, adapters, threads=threads, tile=tile)
        used = [a for a in adapters if a[0].shape[0] > 0]
        expected = reference.fuse_loras(weight.view(np.uint16), used) if used else weight.view(np.uint16)
    assert got.dtype == weight.dtype
    assert np.array_equal(got.view(np.uint16), expected)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def lycoris_adapter(draw, rows, cols, seed):
    """A LoHa or a LoKr for a [rows, cols] weight: LoHa ranks 1-40; LoKr factors that divide
    the weight's shape, each whole or a pair of rank 1-20."""
    scale = draw(st.floats(-8, 8, allow_nan=False, width=32))
    if draw(st.booleans()):
        r1, r2 = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        return ltx2blas.LoHa(bf16_array(seed, (rows, r1), 0.2), bf16_array(seed + 1, (r1, cols), 0.2),
                             bf16_array(seed + 2, (rows, r2), 0.2), bf16_array(seed + 3, (r2, cols), 0.2),
                             scale)
    m1, n1 = draw(st.sampled_from(_divisors(rows))), draw(st.sampled_from(_divisors(cols)))
    factors = []
    for i, (m, n) in enumerate(((m1, n1), (rows // m1, cols // n1))):
        rank = draw(st.one_of(st.none(), st.integers(1, 20)))
        factors.append(bf16_array(seed + 4 + i, (m, n), 0.3) if rank is None else
                       (bf16_array(seed + 6 + i, (m, rank), 0.3), bf16_array(seed + 8 + i, (rank, n), 0.3)))
    return ltx2blas.LoKr(*factors, scale)


@SETTINGS
@given(data=st.data(), rows=st.integers(1, 60), cols=st.integers(1, 72),
       rule=st.sampled_from(["addmm", "sum"]), threads=st.integers(1, 4),
       tile=st.sampled_from([None, (7, 16), (32, 8), (64, 64)]), seed=st.integers(0, 2**30))
def test_lokr_and_loha_among_loras_match_reference(data, rows, cols, rule, threads, tile, seed):
    adapters = []
    for i in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()):
            adapters.append(data.draw(lycoris_adapter(rows, cols, seed + 100 * i)))
        else:
            rank = data.draw(st.integers(1, 40))
            adapters.append((bf16_array(seed + 100 * i, (rank, cols), 0.05),
                             bf16_array(seed + 100 * i + 1, (rows, rank), 0.05),
                             data.draw(st.floats(-8, 8, allow_nan=False, width=32))))
    weight = bf16_array(seed + 999, (rows, cols), 0.05)
    got = ltx2blas.fuse_loras(weight, adapters, rule=rule, threads=threads, tile=tile)
    assert np.array_equal(got, reference.fuse_loras(weight, adapters, rule=rule))


@SETTINGS
@given(rows=st.integers(0, 40), cols=st.integers(1, 600), feats=st.integers(1, 40),
       x_bf16=st.booleans(), w_bf16=st.booleans(), bias=st.sampled_from([None, "f32", "bf16"]),
       threads=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_linear_within_bound_and_deterministic(rows, cols, feats, x_bf16, w_bf16, bias, threads, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = (rng.standard_normal((feats, cols)) * 0.05).astype(np.float32)
    b = None if bias is None else rng.standard_normal(feats).astype(np.float32)
    if x_bf16:
        x = reference.bf16_round(x)
    if w_bf16:
        w = reference.bf16_round(w)
    if bias == "bf16":
        b = reference.bf16_round(b)
    y = ltx2blas.linear(x, w, b, threads=threads)
    assert y.shape == (rows, feats) and y.dtype == np.float32
    assert ltx2blas.linear(x, w, b, threads=1).tobytes() == y.tobytes()
    f64 = lambda a: reference.bf16_widen(a).astype(np.float64) if a.dtype == np.uint16 else a.astype(np.float64)  # noqa: E731
    exact = np.array([[math.fsum(list(f64(x)[m] * f64(w)[o]) + ([f64(b)[o]] if b is not None else []))
                       for o in range(feats)] for m in range(rows)]).reshape(rows, feats)
    magnitude = np.abs(f64(x)) @ np.abs(f64(w)).T + (np.abs(f64(b)) if b is not None else 0)
    ulp = np.spacing(np.abs(y)).astype(np.float64)
    assert np.all(np.abs(y - exact) <= gamma(rows, cols, w.dtype) * magnitude + ulp / 2)


DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "U8": np.uint8, "I64": np.int64,
          "F64": np.float64, "I16": np.int16}


@SETTINGS
@given(spec=st.dictionaries(
           st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF, blacklist_characters="\x7f"),
                   min_size=1, max_size=12).filter(lambda s: s != "__metadata__"),
           st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 5), max_size=3)),
           max_size=6),
       metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
       seed=st.integers(0, 2**31))
def test_safetensors_round_trips(tmp_path_factory, spec, metadata, seed):
    from safetensors.numpy import load_file, save_file

    from ltx2blas.files.safetensors import SafetensorsFile, SafetensorsWriter

    rng = np.random.default_rng(seed)
    tensors = {n: np.asarray(rng.standard_normal(s) * 10).astype(DTYPES[d]) for n, (d, s) in spec.items()}
    folder = tmp_path_factory.mktemp("rt")
    ours = folder / "ours.safetensors"
    with SafetensorsWriter(ours, [(n, d, tuple(s), tensors[n].nbytes) for n, (d, s) in spec.items()],
                           metadata) as w:
        for n in spec:
            w.write(n, tensors[n])
        w.commit()
    back = load_file(str(ours))
    assert set(back) == set(tensors) and all(np.array_equal(back[n], tensors[n]) for n in tensors)
    theirs = folder / "theirs.safetensors"
    save_file(tensors, str(theirs), metadata=metadata or None)
    with SafetensorsFile(theirs) as f:
        assert f.metadata == (metadata or {})
        assert all(np.array_equal(f.read(n), tensors[n]) for n in tensors)
