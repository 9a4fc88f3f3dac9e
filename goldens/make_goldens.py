"""Record the golden cases: small inputs and what ltx2blas.reference (the spec's plain loops)
computes from them.

The reference module is loaded from its file, by path, so no compiled part of ltx2blas -- the
code under test -- takes part in making a golden.  Run from anywhere:

    python goldens/make_goldens.py            # writes goldens/*.npz next to this script
    python goldens/make_goldens.py --check    # recomputes and compares, writes nothing
"""
import argparse
import collections
import importlib.util
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, os.pardir, "ltx2blas", "reference.py")


def load_reference():
    spec = importlib.util.spec_from_file_location("ltx2blas_reference_for_goldens", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fuse_cases(ref):
    """name -> dict of arrays. Each case: weight, adapters (a_i, b_i, strength_i), expected."""
    rng = np.random.default_rng(20260101)

    def bf16(shape, scale):
        return ref.bf16_round(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))

    specs = [
        # name, rows, cols, [(rank, strength), ...], weight scale
        ("rank1", 5, 9, [(1, 1.0)], 0.02),
        ("rank7_negative", 7, 13, [(7, -0.5)], 0.02),
        ("rank384_ltx2", 33, 70, [(384, 0.8)], 0.02),
        ("rank450_ltx25", 17, 40, [(450, 2.5)], 0.02),
        ("rank512_zero_strength", 9, 21, [(512, 0.0)], 0.02),
        ("rank1500", 6, 11, [(1500, -1.25)], 0.02),
        ("two_adapters", 20, 30, [(16, 1.0), (450, 0.75)], 0.02),
        ("three_adapters", 11, 19, [(1024, 0.5), (3, -2.0), (384, 1.0)], 0.02),
        ("large_values", 12, 16, [(64, 3.0)], 40.0),
        ("two_adapters_addmm", 20, 30, [(16, 1.0), (450, 0.75)], 0.02),
        ("three_adapters_addmm", 11, 19, [(1024, 0.5), (3, -2.0), (384, 1.0)], 0.02),
    ]
    cases = {}
    for name, rows, cols, adapters, wscale in specs:
        case = {"weight": bf16((rows, cols), wscale)}
        if name == "rank384_ltx2":
            # special weights: NaN, -NaN, inf, -inf, -0, +0, subnormals, the largest bf16
            case["weight"][0, :9] = [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001,
                                     0x8001, 0x7F7F]
        for i, (rank, strength) in enumerate(adapters):
            case[f"lora_a{i}"] = bf16((rank, cols), 0.01 if wscale < 1 else 1.0)
            case[f"lora_b{i}"] = bf16((rows, rank), 0.01 if wscale < 1 else 1.0)
            case[f"strength{i}"] = np.float64(strength)
        pairs = [(case[f"lora_a{i}"], case[f"lora_b{i}"], float(case[f"strength{i}"]))
                 for i in range(len(adapters))]
        if len(pairs) == 1:
            case["rule"] = np.array("fuse_lora")
            case["expected"] = ref.fuse_lora(case["weight"], *pairs[0])
        else:  # the several-adapter rule by name: "sum" (upstream's first release), "addmm"
            rule = "addmm" if name.endswith("_addmm") else "sum"
            case["rule"] = np.array(f"fuse_loras:{rule}")
            case["expected"] = ref.fuse_loras(case["weight"], pairs, rule)
        cases[name] = case
    return cases


def quantized_cases(ref):
    """Scaled and quantised layouts (docs/arithmetic.md §2): stored codes and scales, two adapters fused by
    the addmm rule, and what the layout's rule gives."""
    rng = np.random.default_rng(20260303)

    def bf16(shape, scale):
        return ref.bf16_round(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))

    cases = {}
    specs = [("fp8_scaled", "F8_E4M3", 128, 256), ("comfy_fp8", "F8_E5M2", 40, 72),
             ("fp8_block", "F8_E4M3", 256, 128), ("fp6_block", None, 128, 256),
             ("nvfp4", None, 130, 96), ("comfy_nvfp4", None, 130, 96),
             ("comfy_mxfp8", "F8_E4M3", 130, 96), ("comfy_int8", None, 40, 72),
             ("comfy_int8", "rows", 40, 72)]

    def tiled(rows, groups, low, high):
        return ref.to_tiled(rng.integers(low, high, (rows, groups)))

    for layout, fmt, rows, cols in specs:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if layout in ("fp8_scaled", "comfy_fp8"):
            scales = (np.array(0.001 if fmt == "F8_E4M3" else 0.00003, np.float32),)
            weight = ref.fp8_round(w * np.float32(0.02) / scales[0], fmt)
        elif layout == "fp8_block":
            scales = (rng.uniform(1e-5, 1e-4, (rows // 128, cols // 128)).astype(np.float32),)
            weight = ref.fp8_round(w * np.float32(60), "F8_E4M3")
        elif layout == "fp6_block":
            scales = (rng.uniform(0.05, 0.2, (rows // 128, cols // 128)).astype(np.float32),)
            codes = ref.fp8_round(np.clip(w * np.float32(0.03), -0.117, 0.117), "F8_E4M3")
            weight = ref.fp6_pack(codes)
        elif layout == "comfy_mxfp8":
            scales = (tiled(rows, cols // 32, 112, 121),)
            weight = ref.fp8_round(w * np.float32(100), "F8_E4M3")
        elif layout == "comfy_int8":
            scales = ((rng.uniform(1e-4, 3e-4, (rows, 1)) if fmt == "rows" else
                       np.array(0.0002)).astype(np.float32),)
            weight = np.clip(np.rint(w * np.float32(60)), -128, 127).astype(np.int8)
        else:
            scales = (tiled(rows, cols // 16, 0x28, 0x60), np.array(0.0007, np.float32))
            weight = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
        case = {"layout": np.array(layout), "fmt": np.array(fmt or "F8_E4M3"), "weight": weight}
        for i, s in enumerate(scales):
            case[f"scale{i}"] = s
        adapters = []
        for i, (rank, strength) in enumerate(((32, 0.8), (200, -1.5))):
            case[f"lora_a{i}"] = bf16((rank, cols), 0.03)
            case[f"lora_b{i}"] = bf16((rows, rank), 0.03)
            case[f"strength{i}"] = np.float64(strength)
            adapters.append((case[f"lora_a{i}"], case[f"lora_b{i}"], strength))
        out = ref.fuse_quantized(layout, weight, scales, adapters, "addmm", fmt or "F8_E4M3")
        case["expected"] = out[0]
        for i, s in enumerate(out[1:]):
            case[f"expected_scale{i}"] = np.asarray(s)
        cases[f"quant_{layout}" + ("_rows" if fmt == "rows" else "")] = case
    return cases


def adapter_kind_cases(ref):
    """Adapter kinds beyond the LoRA pair (docs/arithmetic.md §1): a full-weight difference among LoRAs by
    each rule, DoRA by each style and axis, bias terms."""
    rng = np.random.default_rng(20260404)

    def bf16(shape, scale):
        return ref.bf16_round(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))

    rows, cols = 24, 40
    cases = {}
    weight = bf16((rows, cols), 0.02)
    a, b = bf16((6, cols), 0.05), bf16((rows, 6), 0.05)
    diff = bf16((rows, cols), 0.002)
    for rule in ("addmm", "sum"):
        cases[f"kind_diff_{rule}"] = {
            "weight": weight, "diff": diff, "lora_a": a, "lora_b": b, "rule": np.array(rule),
            "expected": ref.fuse_loras(weight, [(diff, 0.7), (a, b, -1.2)], rule)}
    w64 = ref.bf16_widen(weight).astype(np.float64)
    for style, m in (("peft", np.sqrt((w64 ** 2).sum(axis=1)).astype(np.float32)),
                     ("comfy_out", np.sqrt((w64 ** 2).sum(axis=1)).astype(np.float32).reshape(-1, 1)),
                     ("comfy_in", np.sqrt((w64 ** 2).sum(axis=0)).astype(np.float32).reshape(1, -1))):
        m = m * np.float32(1.03)
        cases[f"kind_dora_{style}"] = {
            "weight": weight, "lora_a": a, "lora_b": b, "magnitude": m, "scale": np.float64(0.5),
            "strength": np.float64(0.8), "style": np.array(style.split("_")[0]),
            "expected": ref.fuse_dora(weight, a, b, m, 0.5, 0.8, style.split("_")[0])}
    bias = bf16((rows,), 0.02)
    terms = [bf16((rows,), 0.01), rng.standard_normal(rows).astype(np.float32) * np.float32(0.01)]
    cases["kind_bias"] = {"bias": bias, "term0": terms[0], "term1": terms[1],
                          "expected": ref.fuse_bias(bias, [(terms[0], 0.5), (terms[1], -1.5)])}
    # LoHa and LoKr alone and among a LoRA and a difference, by each rule; the LoKrs' factors
    # whole and as pairs both ways round
    lyc = {"weight": weight, "lora_a": a, "lora_b": b, "diff": diff}
    for n, r in (("1", 5), ("2", 3)):
        lyc[f"hada_w{n}_a"], lyc[f"hada_w{n}_b"] = bf16((rows, r), 0.2), bf16((r, cols), 0.2)
    lyc["lokr_w1"], lyc["lokr_w2_a"], lyc["lokr_w2_b"] = (bf16((4, 5), 0.3), bf16((6, 3), 0.3),
                                                          bf16((3, 8), 0.3))
    lyc["lokr_w1_a"], lyc["lokr_w1_b"], lyc["lokr_w2"] = (bf16((2, 2), 0.3), bf16((2, 8), 0.3),
                                                          bf16((12, 5), 0.3))
    lyc["loha_scale"] = np.float64(ref.lycoris_scale(-0.8, 2.0, 5))
    lyc["lokr_scale"] = np.float64(ref.lycoris_scale(0.9, 4.0, 3))
    lyc["lokr2_scale"] = np.float64(ref.lycoris_scale(1.1, 4.0, 2))
    for name, items in lycoris_items(lyc).items():
        for rule in ("addmm", "sum"):
            cases[f"kind_{name}_{rule}"] = {**lyc, "rule": np.array(rule),
                                            "expected": ref.fuse_loras(weight, items, rule)}
    return cases


LoHa = collections.namedtuple("LoHa", "w1_a w1_b w2_a w2_b scale")
LoKr = collections.namedtuple("LoKr", "w1 w2 scale")


def lycoris_items(c):
    """The adapter lists of the LoHa/LoKr goldens, by case name, from a case's arrays (the same
    fields as ltx2blas.LoHa and LoKr, which the test builds them as)."""
    loha = LoHa(c["hada_w1_a"], c["hada_w1_b"], c["hada_w2_a"], c["hada_w2_b"],
                float(c["loha_scale"]))
    lokr = LoKr(c["lokr_w1"], (c["lokr_w2_a"], c["lokr_w2_b"]), float(c["lokr_scale"]))
    lokr2 = LoKr((c["lokr_w1_a"], c["lokr_w1_b"]), c["lokr_w2"], float(c["lokr2_scale"]))
    return {"loha": [loha], "lokr": [lokr], "lycoris_mixed": [
        loha, (c["lora_a"], c["lora_b"], -1.2), lokr2, (c["diff"], 0.7), lokr]}


def feature_cases(ref):
    """Text feature extractor cases (docs/arithmetic.md §4): hidden states, mask, projections, the bf16
    features and the exact (f64) projections."""
    rng = np.random.default_rng(20260202)
    cases = {}
    for version, shape, outs in (("v1", (2, 7, 16, 5), (12,)), ("v2", (2, 6, 24, 3), (10, 6))):
        hidden = ref.bf16_round(rng.standard_normal(shape).astype(np.float32) * np.float32(2.5))
        mask = np.ones(shape[:2], bool)
        mask[0, shape[1] - 2:] = False
        mask[1, 0] = False
        width = shape[2] * shape[3]
        case = {"hidden": hidden, "mask": mask, "version": np.array(version)}
        projections = []
        for i, out in enumerate(outs):
            w = ref.bf16_round(rng.standard_normal((out, width)).astype(np.float32) * np.float32(0.05))
            b = None if version == "v1" else rng.standard_normal(out).astype(np.float32)
            case[f"weight{i}"] = w
            if b is not None:
                case[f"bias{i}"] = b
            projections.append((w, b))
            case[f"features{i}"] = ref.text_features_normalized(hidden, mask, version, out)
        for i, y in enumerate(ref.text_features(hidden, mask, projections, version)):
            case[f"expected{i}"] = y
        cases[f"features_{version}"] = case
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the files, write nothing")
    args = parser.parse_args(argv)
    ref = load_reference()
    bad = 0
    cases = {f"fuse_{name}": case for name, case in fuse_cases(ref).items()}
    cases.update(quantized_cases(ref))
    cases.update(adapter_kind_cases(ref))
    cases.update(feature_cases(ref))
    for name, case in cases.items():
        path = os.path.join(HERE, f"{name}.npz")
        if args.check:
            if not os.path.exists(path):
                print(f"MISSING {os.path.basename(path)}")
                bad += 1
                continue
            with np.load(path) as stored:
                same = set(stored.files) == set(case) and all(
                    np.array_equal(stored[k], case[k]) for k in case)
            print(f"{'ok  ' if same else 'DIFF'} {os.path.basename(path)}")
            bad += not same
        else:
            np.savez_compressed(path, **case)
            print(f"wrote {os.path.basename(path)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
