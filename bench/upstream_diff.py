"""How far ltx2blas's results are from its owners' own arithmetic, run in torch, on the same bytes.

Needs torch (``pip install torch==2.13.0``).  For LTX-2-shaped weights and adapters it fuses
with ltx2blas and with the owners' rules (tests/upstream_rules.py: upstream LTX-2's
aggregation and quantisation policies, ComfyUI's fp8, nvfp4, mxfp8 and int8), and counts the
elements that differ -- once with the owners' whole arithmetic (upstream's delta from torch's
bf16 matmul, whose order of additions is not the textbook's; ComfyUI's f32 products added
unrounded, rounded to nearest where ComfyUI adds noise), once with the layout rule alone given
ltx2blas's delta (which must be 0).  Then the text feature extractor: upstream's normalisation in bf16
against ltx2blas's (statistics summed exactly in f64), on synthetic Gemma-like hidden states.

    python bench/upstream_diff.py [--rows 4096 --cols 4096] [--out FILE.json]
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

try:
    import torch
except ImportError as exc:  # one line, not a traceback: the owners' arithmetic runs in torch
    sys.exit(f"upstream_diff: needs torch, which does not import here ({exc}); "
             "pip install torch==2.13.0")

import ltx2blas  # noqa: E402
from ltx2blas import quantized, reference  # noqa: E402
from ltx2blas.info import collect  # noqa: E402

import upstream_rules as up  # noqa: E402


def bf16(rng, shape, scale):
    return reference.bf16_round(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def fraction(a, b):
    a, b = np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
    if a.size != b.size:
        raise ValueError("sizes differ")
    return float(np.mean(a != b))


def rules(rng, rows, cols):
    w = bf16(rng, (rows, cols), 0.02)
    ads = [(bf16(rng, (r, cols), 0.02), bf16(rng, (rows, r), 0.02), s)
           for r, s in ((384, 0.8), (32, 1.0), (450, 0.5))]
    out = {}
    for n in (2, 3):
        theirs = {rule: up.bits(up.fuse_bf16(w, up.aggregate(ads[:n], rule))) for rule in ("addmm", "sum")}
        ours = {rule: ltx2blas.fuse_loras(w, ads[:n], rule=rule) for rule in ("addmm", "sum")}
        out[f"{n} adapters"] = {
            "addmm vs upstream addmm_": fraction(ours["addmm"], theirs["addmm"]),
            "sum vs upstream stacked sum": fraction(ours["sum"], theirs["sum"]),
            "upstream addmm_ vs upstream sum": fraction(theirs["addmm"], theirs["sum"]),
            "addmm vs sum (ltx2blas)": fraction(ours["addmm"], ours["sum"]),
        }
    return out, ads


def layouts(rng, rows, cols, ads):
    ads = ads[:2]
    agg_ours = ltx2blas.fuse.aggregate_delta(rows, cols, ads)
    agg_theirs = up.aggregate(ads, "addmm")
    agg_ours_t = up.bf16_tensor(agg_ours)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.02)
    cases = {}
    scale = np.array(np.abs(w).max() / 448, np.float32)
    codes = quantized_codes(w / scale, "F8_E4M3")
    cases["fp8_scaled"] = (codes, {"scale": scale}, lambda agg: up.fuse_fp8_scaled_mm(codes, scale, agg))
    cases["comfy_fp8"] = (codes, {"scale": scale}, lambda agg: up.fuse_comfy_fp8(codes, scale, agg))
    bs = (np.abs(w).reshape(rows // 128, 128, cols // 128, 128).max(axis=(1, 3)) / 448).astype(np.float32)
    bcodes = quantized_codes(w / np.repeat(np.repeat(bs, 128, 0), 128, 1), "F8_E4M3")
    cases["fp8_block"] = (bcodes, {"scale": bs}, lambda agg: up.fuse_block_fp8(bcodes, bs, agg))
    bs6 = (bs * 448 / np.float32(0.1172)).astype(np.float32)
    packed6 = up.fp6_pack(torch.from_numpy(quantized_codes(
        w / np.repeat(np.repeat(bs6, 128, 0), 128, 1), "F8_E4M3"))).numpy()
    cases["fp6_block"] = (packed6, {"scale": bs6}, lambda agg: up.fuse_block_fp6(packed6, bs6, agg))
    packed, block, s2 = nvfp4_weight(rng, rows, cols)
    cases["nvfp4"] = (packed, {"scale": block, "scale_2": s2},
                      lambda agg: up.fuse_nvfp4(packed, block, s2, agg))
    # ComfyUI's formats: its whole arithmetic is its own deltas (f32 products added to the f32
    # weight in turn), not upstream's bf16 aggregate
    comfy = up.comfy_deltas(ads)
    cases["comfy_nvfp4"] = (packed, {"scale": block, "scale_2": s2},
                            lambda agg: up.comfy_nvfp4(packed, block, s2, agg))
    mcodes, mscales = mxfp8_weight(rng, rows, cols)
    cases["comfy_mxfp8"] = (mcodes, {"scale": mscales},
                            lambda agg: up.comfy_mxfp8(mcodes, mscales, agg))
    iscale = np.array(np.abs(w).max() / 127, np.float32)
    icodes = np.clip(np.rint(w / iscale), -128, 127).astype(np.int8)
    cases["comfy_int8"] = (icodes, {"scale": iscale}, lambda agg: up.comfy_int8(icodes, iscale, agg))
    out = {}
    for name, (weight, kw, theirs_of) in cases.items():
        ours = quantized.fuse_quantized(name, weight, ads, **kw)
        full = theirs_of(comfy if name.startswith("comfy") else agg_theirs)
        same_delta = theirs_of(agg_ours_t)
        owner = "ComfyUI" if name.startswith("comfy") else "upstream"
        out[name] = {
            f"codes, {owner}'s whole arithmetic": fraction(ours.weight, full[0]),
            f"scales, {owner}'s whole arithmetic": fraction(ours.scale, full[1]),
            "codes, same delta": fraction(ours.weight, same_delta[0]),
            "scales, same delta": fraction(ours.scale, same_delta[1]),
            "codes differing, same delta (count)": int(np.sum(
                np.asarray(ours.weight).view(np.uint8) != np.asarray(same_delta[0]).view(np.uint8))),
            "codes differing, whole arithmetic (count)": int(np.sum(
                np.asarray(ours.weight).view(np.uint8) != np.asarray(full[0]).view(np.uint8))),
            "codes": int(np.asarray(ours.weight).size),
        }
    return out


def mxfp8_weight(rng, rows, cols):
    """A bf16 weight quantised by comfy-kitchen's mxfp8 rule (through ComfyUI's, with a zero
    delta, from zero codes: every group merges to the weight itself)."""
    w = up.bf16_tensor(bf16(rng, (rows, cols), 0.02))
    zero = np.zeros((rows, cols), np.uint8)
    padded = quantized.tiled_shape("comfy_mxfp8", rows, cols)
    return up.comfy_mxfp8(zero, np.zeros(padded, np.uint8), w)


def quantized_codes(x, fmt):
    return torch.from_numpy(np.clip(x, -448, 448).astype(np.float32)).to(up.E4M3).view(torch.uint8).numpy()


def nvfp4_weight(rng, rows, cols):
    """A bf16 weight quantised by the NVFP4 rule (the fuse of a zero delta into zero codes
    with unit scales is not one; quantise directly)."""
    w = up.bf16_tensor(bf16(rng, (rows, cols), 0.02))
    zero_packed = np.zeros((rows, cols // 2), np.uint8)
    padded = (-(-rows // 128) * 128, -(-(cols // 16) // 4) * 4)
    packed, block, t = up.fuse_nvfp4(zero_packed, np.zeros(padded, np.uint8),
                                     np.array(0, np.float32), w)
    return packed, block, np.asarray(t, np.float32).reshape(())


def features(rng, tokens):
    d, l = 3840, 49
    # Gemma-like: per-layer scales growing with depth, a few outlier dimensions, bf16
    scale = np.linspace(0.5, 40, l).astype(np.float32)
    h = rng.standard_normal((1, tokens, d, l), dtype=np.float32) * scale
    h[:, :, rng.choice(d, 8, replace=False), :] *= 30
    hb = torch.from_numpy(h).to(torch.bfloat16)
    hbits = up.bits(hb)
    mask = np.ones((1, tokens), bool)
    mask[0, tokens * 3 // 4:] = False
    tmask = torch.from_numpy(mask)
    out = {}
    w = bf16(rng, (64, d * l), 0.002)
    for version in ("v1", "v2"):
        theirs = up.features_v1(hb, tmask) if version == "v1" else up.features_v2(hb, tmask, 4096)
        ours = ltx2blas.normalized_features(hbits, mask, version=version, out_features=4096)
        t = up.bits(theirs.to(torch.bfloat16))[mask]
        o = ours[mask]
        diff = t != o
        tv = t.astype(np.uint32) << 16
        ov = o.astype(np.uint32) << 16
        rel = np.abs(tv.view(np.float32).astype(np.float64) - ov.view(np.float32)) / np.maximum(
            np.abs(ov.view(np.float32)), 1e-30)
        # the projection both feed: bf16 F.linear on their features, ltx2blas.linear on ours
        y_theirs = torch.nn.functional.linear(theirs.to(torch.bfloat16)[0][torch.from_numpy(mask[0])],
                                              up.bf16_tensor(w)).float().numpy()
        y_ours = ltx2blas.linear(o, w)
        steps = np.abs(t.view(np.int16).astype(np.int32) - o.view(np.int16).astype(np.int32))
        out[version] = {
            "features differing": float(np.mean(diff)),
            "largest difference, bf16 steps (same sign)": int(
                steps[diff & (np.signbit(tv.view(np.float32)) == np.signbit(ov.view(np.float32)))].max(initial=0)),
            "sign or zero differs": int(np.sum(diff & (np.signbit(tv.view(np.float32)) != np.signbit(ov.view(np.float32))))),
            "of those differing, by one bf16 step": float(np.mean(steps[diff] == 1)) if diff.any() else 1.0,
            "largest |difference| / largest |feature|": float(
                np.max(np.abs(tv.view(np.float32) - ov.view(np.float32))) / np.max(np.abs(ov.view(np.float32)))),
            "median relative difference where they differ": float(np.median(rel[diff])) if diff.any() else 0.0,
            "projection: max |ours - upstream| / max |upstream|":
                float(np.max(np.abs(y_ours - y_theirs)) / np.max(np.abs(y_theirs))),
        }
    return out


def lycoris_cases(rng, rows, cols, rank=32):
    """(name, kind, tensors by role, alpha) of a rank-32 LoHa and of LoKrs of factor 8 and 16
    (LyCORIS' layout: w1 [f, f] whole, w2 [rows / f, cols / f] as a pair of the rank), and of a
    LoKr whose w2 is whole, at LoRA-like magnitudes."""
    cases = [("LoHa rank 32", "loha", {
        "w1_a": bf16(rng, (rows, rank), 0.1), "w1_b": bf16(rng, (rank, cols), 0.1),
        "w2_a": bf16(rng, (rows, rank), 0.1), "w2_b": bf16(rng, (rank, cols), 0.1)}, 16.0)]
    for f in (8, 16):
        cases.append((f"LoKr factor {f} rank 32", "lokr", {
            "w1": bf16(rng, (f, f), 0.5), "w2_a": bf16(rng, (rows // f, rank), 0.05),
            "w2_b": bf16(rng, (rank, cols // f), 0.05)}, 16.0))
    cases.append(("LoKr factor 8, w2 whole", "lokr", {
        "w1": bf16(rng, (8, 8), 0.5), "w2": bf16(rng, (rows // 8, cols // 8), 0.005)}, None))
    return cases


def lycoris_item(kind, t, strength, alpha):
    """The ltx2blas adapter of a lycoris_cases entry, its scale c as the file layer computes it."""
    if kind == "loha":
        dim = t["w1_b"].shape[0]
        return ltx2blas.LoHa(t["w1_a"], t["w1_b"], t["w2_a"], t["w2_b"],
                             reference.lycoris_scale(strength, alpha, dim))
    factors = [t[n] if n in t else (t[n + "_a"], t[n + "_b"]) for n in ("w1", "w2")]
    dim = next((t[n + "_b"].shape[0] for n in ("w2", "w1") if n + "_b" in t), None)
    return ltx2blas.LoKr(*factors, reference.lycoris_scale(strength, alpha, dim))


def lycoris_against_comfy(w, kind, t, alpha, strength=0.8):
    """Elements of ltx2blas's fused weight that differ from ComfyUI's; of its f32 scaled
    product c * (product) from ComfyUI's (the low-rank products' order of additions: the
    textbook's against torch.mm's); and of the weight ComfyUI would get from ltx2blas's f32
    scaled product added unrounded (what rounding the delta to bf16 first changes)."""
    item = lycoris_item(kind, t, strength, alpha)
    theirs = up.comfy_lycoris(w, kind, t, strength, alpha)
    ours = ltx2blas.fuse_loras(w, [item])
    product = np.asarray(reference.later_term(item)[0], np.float32)
    ours32 = np.float32(item.scale) * product
    diff, dim = up.comfy_lycoris_diff(kind, t)
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    theirs32 = ((strength * scale) * diff.reshape(w.shape)).numpy()
    unrounded = reference.bf16_round(reference.bf16_widen(w) + ours32)
    return {"elements": int(w.size),
            "fused weights differ": int(np.count_nonzero(ours != theirs)),
            "f32 scaled products differ": int(np.count_nonzero(
                ours32.view(np.uint32) != theirs32.view(np.uint32))),
            "largest difference, in bf16 steps at the larger of the weight and the result":
                largest_steps(w, ours, theirs),
            "with ltx2blas's product added unrounded, fused weights differ":
                int(np.count_nonzero(unrounded != theirs))}


def largest_steps(w, ours, theirs):
    """max |ours - theirs| over the bf16 spacing at max(|w|, |ours|, |theirs|), element by
    element: where the weight and the delta cancel, both results are tiny and steps counted at
    the result alone would be huge for a difference below the inputs' own rounding."""
    v = [reference.bf16_widen(x).astype(np.float64) for x in (w, ours, theirs)]
    top = np.maximum(np.maximum(np.abs(v[0]), np.abs(v[1])), np.abs(v[2]))
    step = np.exp2(np.floor(np.log2(np.maximum(top, 2.0**-126))) - 7)
    return float(np.max(np.abs(v[1] - v[2]) / step))


def adapter_kinds(rng, rows, cols):
    """Each adapter kind against ComfyUI's (and for DoRA PEFT's) arithmetic, which differs from
    ltx2blas's rules by design: their products are f32 (ComfyUI) or bf16 matmuls (PEFT), and the
    delta is not rounded to bf16 before it is added."""
    w = bf16(rng, (rows, cols), 0.02)
    a, b = bf16(rng, (32, cols), 0.02), bf16(rng, (rows, 32), 0.02)
    diff = bf16(rng, (rows, cols), 0.0005)
    w64 = reference.bf16_widen(w).astype(np.float64)
    m_rows = (np.sqrt((w64 ** 2).sum(axis=1)) * 1.02).astype(np.float32)
    m_cols = (np.sqrt((w64 ** 2).sum(axis=0)) * 1.02).astype(np.float32)
    alpha = 16.0
    out = {}
    ours = ltx2blas.fuse_lora(w, a, b, 0.8 * alpha / 32)
    out["lora vs ComfyUI"] = fraction(ours, up.comfy_lora(w, b, a, 0.8, alpha))
    ours = ltx2blas.fuse_loras(w, [(diff, 0.8)])
    out["diff vs ComfyUI"] = fraction(ours, up.comfy_diff(w, diff, 0.8))
    for name, m in (("dora_scale [out, 1]", m_rows.reshape(-1, 1)), ("dora_scale [1, in]", m_cols.reshape(1, -1))):
        ours = ltx2blas.fuse_dora(w, a, b, m, scale=alpha / 32, strength=0.8, style="comfy")
        out[f"DoRA {name} vs ComfyUI"] = fraction(ours, up.comfy_dora(w, b, a, m, 0.8, alpha))
    ours = ltx2blas.fuse_dora(w, a, b, m_rows, scale=alpha / 32, style="peft")
    out["DoRA lora_magnitude_vector vs PEFT merge"] = fraction(
        ours, up.peft_dora(w, a, b, m_rows, alpha / 32))
    for name, kind, t, alpha in lycoris_cases(rng, rows, cols):
        out[f"{name} vs ComfyUI"] = lycoris_against_comfy(w, kind, t, alpha)
    bias = bf16(rng, (rows,), 0.02)
    term = rng.standard_normal(rows).astype(np.float32) * np.float32(0.01)
    theirs = up.bits((up.bf16_tensor(bias).to(torch.float32) + 0.8 * torch.from_numpy(term)).to(torch.bfloat16))
    out["diff_b vs ComfyUI"] = fraction(ltx2blas.fuse.fuse_bias(bias, [(term, 0.8)]), theirs)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", help="write the figures here as JSON")
    parser.add_argument("--only", choices=("rules", "layouts", "features", "adapters"),
                        action="append",
                        help="measure only these parts (repeatable)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(20261201)
    t0 = time.time()
    info = collect()
    result = {"machine": {k: info.get(k) for k in ("cpu", "cpu_features", "kernel", "blas")} | {
                  "python": platform.python_version(), "torch": torch.__version__,
                  "ltx2blas": ltx2blas.__version__},
              "shape": [args.rows, args.cols]}
    only = set(args.only or ("rules", "layouts", "features", "adapters"))
    if only & {"rules", "layouts"}:
        result["rules"], ads = rules(rng, args.rows, args.cols)
    if "rules" not in only:
        result.pop("rules", None)
    if "layouts" in only:
        result["layouts"] = layouts(rng, args.rows, args.cols, ads)
    if "features" in only:
        result["features"] = features(np.random.default_rng(20261202), args.tokens)
    if "adapters" in only:
        result["adapter kinds"] = adapter_kinds(np.random.default_rng(20261203), args.rows, args.cols)
    result["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
