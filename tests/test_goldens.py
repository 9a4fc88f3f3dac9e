"""Recorded cases (goldens/, made by goldens/make_goldens.py from ltx2blas.reference alone):
the library must reproduce them byte for byte, and so must the reference itself (a change to
the oracle shows here first)."""
import glob
import os

import numpy as np
import pytest

import ltx2blas
import ltx2blas.quantized
from ltx2blas import reference

GOLDENS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "goldens")
FUSE_CASES = sorted(glob.glob(os.path.join(GOLDENS, "fuse_*.npz")))


def load(path):
    with np.load(path) as f:
        case = {k: f[k] for k in f.files}
    n = sum(1 for k in case if k.startswith("lora_a"))
    adapters = [(case[f"lora_a{i}"], case[f"lora_b{i}"], float(case[f"strength{i}"]))
                for i in range(n)]
    return case, adapters


def test_goldens_exist():
    assert len(FUSE_CASES) >= 11
    rules = {str(load(p)[0]["rule"]) for p in FUSE_CASES}
    assert rules == {"fuse_lora", "fuse_loras:sum", "fuse_loras:addmm"}


@pytest.mark.parametrize("path", FUSE_CASES, ids=os.path.basename)
@pytest.mark.parametrize("threads, tile", [(1, None), (2, (8, 16)), (3, (5, 7))])
def test_fuse_reproduces_golden(path, threads, tile):
    case, adapters = load(path)
    if str(case["rule"]) == "fuse_lora":
        got = ltx2blas.fuse_lora(case["weight"], *adapters[0], threads=threads, tile=tile)
    else:
        rule = str(case["rule"]).split(":")[1]
        got = ltx2blas.fuse_loras(case["weight"], adapters, rule=rule, threads=threads, tile=tile)
    assert np.array_equal(got, case["expected"])


@pytest.mark.parametrize("path", FUSE_CASES, ids=os.path.basename)
def test_reference_reproduces_golden(path):
    case, adapters = load(path)
    if str(case["rule"]) == "fuse_lora":
        again = reference.fuse_lora(case["weight"], *adapters[0])
    else:
        again = reference.fuse_loras(case["weight"], adapters, str(case["rule"]).split(":")[1])
    assert np.array_equal(again, case["expected"])


QUANT_CASES = sorted(glob.glob(os.path.join(GOLDENS, "quant_*.npz")))


def test_quantized_goldens_exist():
    layouts = {str(load(p)[0]["layout"]) for p in QUANT_CASES}
    assert layouts == set(ltx2blas.quantized.LAYOUTS)


def _quant_args(case):
    scales = [case[k] for k in ("scale0", "scale1") if k in case]
    expected = [case["expected"]] + [case[k] for k in ("expected_scale0", "expected_scale1")
                                     if k in case]
    return str(case["layout"]), str(case["fmt"]), scales, expected


@pytest.mark.parametrize("path", QUANT_CASES, ids=os.path.basename)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fuse_quantized_reproduces_golden(path, threads):
    case, adapters = load(path)
    layout, fmt, scales, expected = _quant_args(case)
    got = ltx2blas.quantized.fuse_quantized(
        layout, case["weight"], adapters, scale=scales[0],
        scale_2=scales[1] if len(scales) > 1 else None, fmt=fmt if layout.endswith("fp8") or
        layout == "fp8_scaled" else None, threads=threads)
    for value, want in zip(got, expected):
        assert np.array_equal(np.asarray(value).reshape(-1).view(np.uint8),
                              np.asarray(want).reshape(-1).view(np.uint8))


@pytest.fixture(params=ltx2blas.fuse.FUSE_KERNELS)
def forced_fuse_kernel(request):
    """The fuse's kernel forced either way (the dot-product kernel where the table has one and
    the magnitudes allow it, or never), as LTX2BLAS_FUSE_KERNEL forces it."""
    forced = ltx2blas.fuse.forced_fuse_kernel()
    ltx2blas.fuse.use_fuse_kernel(request.param)
    yield request.param
    ltx2blas.fuse.use_fuse_kernel(forced)


@pytest.mark.parametrize("path", FUSE_CASES + QUANT_CASES, ids=os.path.basename)
def test_goldens_on_either_fuse_kernel(path, forced_fuse_kernel):
    """The route chosen by measured rate changes no byte: forced either way, every fuse and
    quantised golden is reproduced."""
    case, adapters = load(path)
    if "layout" in case:
        layout, fmt, scales, expected = _quant_args(case)
        got = ltx2blas.quantized.fuse_quantized(
            layout, case["weight"], adapters, scale=scales[0],
            scale_2=scales[1] if len(scales) > 1 else None, fmt=fmt if layout.endswith("fp8") or
            layout == "fp8_scaled" else None, threads=2)
    elif str(case["rule"]) == "fuse_lora":
        expected = [case["expected"]]
        got = [ltx2blas.fuse_lora(case["weight"], *adapters[0], threads=2, tile=(8, 16))]
    else:
        expected = [case["expected"]]
        got = [ltx2blas.fuse_loras(case["weight"], adapters, rule=str(case["rule"]).split(":")[1],
                                   threads=2, tile=(8, 16))]
    for value, want in zip(got, expected):
        assert np.array_equal(np.asarray(value).reshape(-1).view(np.uint8),
                              np.asarray(want).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("path", QUANT_CASES, ids=os.path.basename)
def test_reference_reproduces_quantized_golden(path):
    case, adapters = load(path)
    layout, fmt, scales, expected = _quant_args(case)
    again = reference.fuse_quantized(layout, case["weight"], scales, adapters, "addmm", fmt)
    for value, want in zip(again, expected):
        assert np.array_equal(np.asarray(value).reshape(-1).view(np.uint8),
                              np.asarray(want).reshape(-1).view(np.uint8))


FEATURE_CASES = sorted(glob.glob(os.path.join(GOLDENS, "features_*.npz")))


def test_feature_goldens_exist():
    assert len(FEATURE_CASES) == 2


@pytest.mark.parametrize("path", FEATURE_CASES, ids=os.path.basename)
def test_text_features_reproduce_golden(path):
    from ltx2blas.linear_layer import error_bound

    with np.load(path) as f:
        case = {k: f[k] for k in f.files}
    version = str(case["version"])
    count = sum(1 for k in case if k.startswith("weight"))
    projs = [(case[f"weight{i}"], case.get(f"bias{i}")) for i in range(count)]
    mask = case["mask"]
    got = ltx2blas.text_features(case["hidden"], mask, projs, version=version)
    for i, ((w, b), y) in enumerate(zip(projs, got)):
        feats = ltx2blas.normalized_features(case["hidden"], mask, version=version,
                                             out_features=w.shape[0])
        assert np.array_equal(feats, case[f"features{i}"])
        # the derived bound of the route linear() takes on these bf16 features
        bound = error_bound(feats[mask], w, b) + np.spacing(np.abs(y[mask])) / 2
        assert np.all(np.abs(y[mask] - case[f"expected{i}"][mask]) <= bound)
        assert np.array_equal(y[~mask], case[f"expected{i}"][~mask].astype(np.float32))


KIND_CASES = sorted(glob.glob(os.path.join(GOLDENS, "kind_*.npz")))


def test_adapter_kind_goldens_exist():
    names = {os.path.basename(p) for p in KIND_CASES}
    assert {"kind_diff_addmm.npz", "kind_diff_sum.npz", "kind_dora_peft.npz",
            "kind_dora_comfy_out.npz", "kind_dora_comfy_in.npz", "kind_bias.npz",
            "kind_loha_addmm.npz", "kind_lokr_sum.npz", "kind_lycoris_mixed_addmm.npz",
            "kind_lycoris_mixed_sum.npz"} <= names


def lycoris_items(c):
    """The goldens' LoHa/LoKr adapter lists (as goldens/make_goldens.py builds them), as the
    array API's LoHa and LoKr."""
    loha = ltx2blas.LoHa(c["hada_w1_a"], c["hada_w1_b"], c["hada_w2_a"], c["hada_w2_b"],
                         float(c["loha_scale"]))
    lokr = ltx2blas.LoKr(c["lokr_w1"], (c["lokr_w2_a"], c["lokr_w2_b"]), float(c["lokr_scale"]))
    lokr2 = ltx2blas.LoKr((c["lokr_w1_a"], c["lokr_w1_b"]), c["lokr_w2"], float(c["lokr2_scale"]))
    return {"loha": [loha], "lokr": [lokr], "lycoris_mixed": [
        loha, (c["lora_a"], c["lora_b"], -1.2), lokr2, (c["diff"], 0.7), lokr]}


@pytest.mark.parametrize("path", KIND_CASES, ids=os.path.basename)
@pytest.mark.parametrize("threads", [1, 3])
def test_adapter_kinds_reproduce_golden(path, threads):
    with np.load(path) as f:
        c = {k: f[k] for k in f.files}
    name = os.path.basename(path)
    if name.startswith("kind_diff"):
        items = [(c["diff"], 0.7), (c["lora_a"], c["lora_b"], -1.2)]
        got = ltx2blas.fuse_loras(c["weight"], items, rule=str(c["rule"]), threads=threads)
        again = reference.fuse_loras(c["weight"], items, str(c["rule"]))
    elif name.startswith("kind_dora"):
        args = (c["weight"], c["lora_a"], c["lora_b"], c["magnitude"])
        got = ltx2blas.fuse_dora(*args, scale=float(c["scale"]), strength=float(c["strength"]),
                                 style=str(c["style"]), threads=threads)
        again = reference.fuse_dora(*args, float(c["scale"]), float(c["strength"]), str(c["style"]))
    elif name.startswith(("kind_lo", "kind_lycoris")):
        kind = name[len("kind_"):name.rindex("_")]
        items = lycoris_items(c)[kind]
        got = ltx2blas.fuse_loras(c["weight"], items, rule=str(c["rule"]), threads=threads)
        again = reference.fuse_loras(c["weight"], items, str(c["rule"]))
    else:
        items = [(c["term0"], 0.5), (c["term1"], -1.5)]
        got = ltx2blas.fuse.fuse_bias(c["bias"], items)
        again = reference.fuse_bias(c["bias"], items)
    assert np.array_equal(got, c["expected"]) and np.array_equal(again, c["expected"])
