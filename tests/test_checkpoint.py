"""Fusing adapter files into checkpoints: byte-exact against the tensor-level fuse, untouched
tensors copied byte for byte, metadata kept and extended, key matching, refusals, safe writing,
sharded inputs, fp8, and loaders' in-memory state dicts."""
import json
import os
import threading

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.files import checkpoint
from ltx2blas.files.safetensors import SafetensorsFile

import ckpt_helpers as ck

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."


@pytest.fixture
def files(tmp_path, rng):
    model = ck.model(rng)
    a1 = ck.adapter(rng, ["transformer_blocks.0.attn1.to_q", "transformer_blocks.0.ff.net.0.proj"], rank=8)
    a2 = ck.adapter(rng, ["transformer_blocks.0.attn1.to_q", "transformer_blocks.1.attn1.to_q"],
                    rank=5, prefix="", style="kohya", alpha=10.0)
    paths = {
        "model": ck.write(tmp_path / "model.safetensors", model, {"format": "pt", "note": "x"}),
        "a1": ck.write(tmp_path / "a1.safetensors", a1),
        "a2": ck.write(tmp_path / "a2.safetensors", a2),
        "out": tmp_path / "out.safetensors",
    }
    return paths, model, a1, a2


def read_all(path):
    with SafetensorsFile(path) as f:
        return {n: (f.tensors[n].dtype, f.read(n)) for n in f.tensors}, f.metadata, list(f.tensors)


def test_fused_tensors_equal_the_tensor_level_fuse(files):
    paths, model, a1, a2 = files
    report = ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.8), (paths["a2"], -1.5)],
                                      paths["out"], threads=2)
    out, meta, order = read_all(paths["out"])
    assert order == list(read_all(paths["model"])[2])  # same tensors, same order
    q = "transformer_blocks.0.attn1.to_q"
    # to_q of block 0: both adapters, in order; a2 is kohya with alpha 10, rank 5 -> x 2
    expected = ltx2blas.fuse_loras(model[M + q + ".weight"][1], [
        (a1["diffusion_model." + q + ".lora_A.weight"][1], a1["diffusion_model." + q + ".lora_B.weight"][1], 0.8),
        (a2[q + ".lora_down.weight"][1], a2[q + ".lora_up.weight"][1], -1.5 * 10 / 5)])
    assert np.array_equal(out[M + q + ".weight"][1], expected)
    assert np.array_equal(expected, reference.fuse_loras(model[M + q + ".weight"][1], [
        (a1["diffusion_model." + q + ".lora_A.weight"][1], a1["diffusion_model." + q + ".lora_B.weight"][1], 0.8),
        (a2[q + ".lora_down.weight"][1], a2[q + ".lora_up.weight"][1], -3.0)]))
    ff = "transformer_blocks.0.ff.net.0.proj"
    assert np.array_equal(out[M + ff + ".weight"][1], reference.fuse_loras(model[M + ff + ".weight"][1], [
        (a1["diffusion_model." + ff + ".lora_A.weight"][1], a1["diffusion_model." + ff + ".lora_B.weight"][1], 0.8)]))
    # everything else byte for byte
    fused = {M + q + ".weight", M + ff + ".weight", M + "transformer_blocks.1.attn1.to_q.weight"}
    for name, (dtype, value) in model.items():
        if name not in fused:
            assert np.array_equal(out[name][1].view(np.uint8), value.view(np.uint8)), name
            assert out[name][0] == dtype
    assert report.modules_fused == 3 and report.tensors_copied == len(model) - 3
    assert report.adapters[1].alpha_scaled == 2
    # metadata: kept, and extended with what was fused
    assert meta["format"] == "pt" and meta["note"] == "x"
    fused_meta = json.loads(meta[checkpoint.FUSED_KEY])
    assert [f["file"] for f in fused_meta] == ["a1.safetensors", "a2.safetensors"]
    assert fused_meta[0]["strength"] == 0.8
    import hashlib

    for entry, key in zip(fused_meta, ("a1", "a2")):
        assert entry["sha256"] == hashlib.sha256(paths[key].read_bytes()).hexdigest()
    assert meta["ltx2blas.version"]


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17])
def test_adapter_hash_reads_the_whole_file_in_chunks(tmp_path, size):
    """One pass gives the file's SHA-256 and each tensor's digest (BLAKE3, or SHA-256 for
    format 1 records), whatever the chunk cuts."""
    import hashlib

    import blake3

    from ltx2blas.files import provenance

    rng = np.random.default_rng(size)
    tensors = {"a": ("U8", rng.integers(0, 256, size, dtype=np.uint8)),
               "b": ("U8", rng.integers(0, 256, 4096 - size % 4096, dtype=np.uint8)),
               "c": ("U8", np.zeros(0, np.uint8))}
    path = ck.write(tmp_path / "blob.safetensors", tensors)
    for hash_name, new in (("blake3", blake3.blake3), ("sha256", hashlib.sha256)):
        with SafetensorsFile(path) as f:
            whole, parts = provenance.file_digests(f, chunk=4096, hash_name=hash_name)
        assert whole == hashlib.sha256(path.read_bytes()).hexdigest()
        assert parts == {n: new(v.tobytes()).hexdigest() for n, (_, v) in tensors.items()}


def test_thread_count_does_not_change_the_file(files, tmp_path):
    paths = files[0]
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], tmp_path / "t1.safetensors", threads=1)
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], tmp_path / "t3.safetensors", threads=3)
    assert (tmp_path / "t1.safetensors").read_bytes() == (tmp_path / "t3.safetensors").read_bytes()


def test_reference_package_reads_the_output(files):
    paths = files[0]
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], paths["out"])
    from safetensors import safe_open

    with safe_open(str(paths["out"]), "numpy") as f:
        assert set(f.keys()) == set(files[1])
        assert "ltx2blas.fused" in f.metadata()


def test_dry_run_writes_nothing(files):
    paths = files[0]
    report = ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0), (paths["a2"], 1.0)],
                                      paths["out"], dry_run=True)
    assert report.dry_run and report.modules_fused == 3 and report.gflop > 0
    assert not paths["out"].exists()
    assert "would fuse 3 modules" in report.summary()


def test_second_fuse_is_refused_unless_forced(files, tmp_path):
    paths = files[0]
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], paths["out"])
    again = tmp_path / "again.safetensors"
    with pytest.raises(errors.AlreadyFusedError, match="already fused"):
        ltx2blas.fuse_checkpoint(paths["out"], [(paths["a1"], 1.0)], again)
    assert not again.exists()
    ltx2blas.fuse_checkpoint(paths["out"], [(paths["a1"], 1.0)], again, force=True)
    assert again.exists()


def test_output_equal_to_an_input_is_refused(files):
    paths = files[0]
    before = paths["model"].read_bytes()
    for target in (paths["model"], paths["a1"]):
        with pytest.raises(errors.ArgumentError, match="is an input"):
            ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], target)
    link = paths["model"].parent / "link.safetensors"
    os.symlink(paths["model"], link)
    with pytest.raises(errors.ArgumentError, match="is an input"):
        ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], link)
    assert paths["model"].read_bytes() == before


def test_adapter_that_matches_nothing_is_an_error(files, tmp_path, rng):
    paths = files[0]
    stray = ck.write(tmp_path / "stray.safetensors", {
        "diffusion_model.nothing.lora_A.weight": ("BF16", np.zeros((2, 48), np.uint16)),
        "diffusion_model.nothing.lora_B.weight": ("BF16", np.zeros((64, 2), np.uint16))})
    with pytest.raises(errors.KeyMatchError, match="matches no weight"):
        ltx2blas.fuse_checkpoint(paths["model"], [(stray, 1.0)], paths["out"])
    assert not paths["out"].exists()


def test_a_without_b_and_lonely_alpha_are_errors(files, tmp_path):
    paths = files[0]
    half = ck.write(tmp_path / "half.safetensors", {
        "diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight": ("BF16", np.zeros((2, 48), np.uint16))})
    with pytest.raises(errors.KeyMatchError, match="no lora_B"):
        ltx2blas.fuse_checkpoint(paths["model"], [(half, 1.0)], paths["out"])
    lonely = ck.write(tmp_path / "lonely.safetensors", {
        "transformer_blocks.0.attn1.to_q.alpha": ("F32", np.array(4.0, np.float32))})
    with pytest.raises(errors.KeyMatchError, match="alpha"):
        ltx2blas.fuse_checkpoint(paths["model"], [(lonely, 1.0)], paths["out"])


def test_unmatched_pairs_are_an_error_unless_allowed(files, tmp_path, rng):
    paths, model, a1, _ = files
    extra = dict(a1)
    extra["diffusion_model.elsewhere.lora_A.weight"] = ("BF16", np.zeros((2, 8), np.uint16))
    extra["diffusion_model.elsewhere.lora_B.weight"] = ("BF16", np.zeros((8, 2), np.uint16))
    extra["lora_te_text_model_layer_0_q_proj.lora_down.weight"] = ("BF16", np.zeros((2, 8), np.uint16))
    extra["lora_te_text_model_layer_0_q_proj.lora_up.weight"] = ("BF16", np.zeros((8, 2), np.uint16))
    extra["notes"] = ("F32", np.zeros(3, np.float32))
    path = ck.write(tmp_path / "extra.safetensors", extra)
    with pytest.raises(errors.KeyMatchError) as err:
        ltx2blas.fuse_checkpoint(paths["model"], [(path, 1.0)], paths["out"])
    text = str(err.value)
    assert "2 adapter modules match no weight" in text and "diffusion_model.elsewhere" in text
    assert "lora_te_text_model_layer_0_q_proj (text encoder)" in text
    assert "1 key is not a tensor of any adapter kind ltx2blas knows" in text
    assert "'notes'" in text and "nothing was written" in text
    assert not paths["out"].exists()
    report = ltx2blas.fuse_checkpoint(paths["model"], [(path, 1.0)], paths["out"],
                                      allow_unmatched=True)
    a = report.adapters[0]
    assert a.unused_keys == ["notes"]
    assert sorted(a.unmatched_modules) == ["diffusion_model.elsewhere",
                                           "lora_te_text_model_layer_0_q_proj"]
    assert a.unmatched_components == {"lora_te_text_model_layer_0_q_proj": "text encoder"}
    assert "2 modules match no weight and were not fused" in report.summary()
    assert "1 key of no known role" in report.summary()
    assert report.modules_fused == 2


def test_kohya_flattened_names(files, tmp_path, rng):
    paths, model, _, _ = files
    flat = ck.adapter(rng, ["transformer_blocks.1.attn1.to_q"], rank=4, prefix="lora_unet_",
                      style="kohya_flat")
    path = ck.write(tmp_path / "flat.safetensors", flat)
    report = ltx2blas.fuse_checkpoint(paths["model"], [(path, 0.5)], paths["out"])
    assert [n for n, _ in report.fused] == [M + "transformer_blocks.1.attn1.to_q.weight"]


def test_shape_mismatch_names_the_module(files, tmp_path):
    paths = files[0]
    bad = ck.write(tmp_path / "bad.safetensors", {
        "diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight": ("BF16", np.zeros((2, 47), np.uint16)),
        "diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight": ("BF16", np.zeros((64, 2), np.uint16))})
    with pytest.raises(errors.ShapeError, match="to_q"):
        ltx2blas.fuse_checkpoint(paths["model"], [(bad, 1.0)], paths["out"])


def test_f32_adapter_factors_are_rounded_and_reported(files, tmp_path, rng):
    paths, model, a1, _ = files
    as_f32 = {k: ("F32", reference.bf16_widen(v)) for k, (_, v) in a1.items()}
    path = ck.write(tmp_path / "f32.safetensors", as_f32)
    report = ltx2blas.fuse_checkpoint(paths["model"], [(path, 1.0)], paths["out"])
    assert len(report.adapters[0].rounded_to_bf16) == 4
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], paths["out"].with_name("b.safetensors"))
    assert paths["out"].read_bytes()[-4096:] == paths["out"].with_name("b.safetensors").read_bytes()[-4096:]


def test_failure_mid_write_leaves_nothing(files, monkeypatch):
    paths = files[0]
    paths["out"].write_bytes(b"previous output")
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = checkpoint._fuse_one
    monkeypatch.setattr(checkpoint, "_fuse_one", failing)
    with pytest.raises(KeyboardInterrupt):
        ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], paths["out"])
    assert paths["out"].read_bytes() == b"previous output"
    assert sorted(os.listdir(paths["out"].parent)) == ["a1.safetensors", "a2.safetensors",
                                                        "model.safetensors", "out.safetensors"]


def test_progress_is_reported(files):
    paths = files[0]
    seen = []
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], paths["out"], progress=seen.append)
    assert seen[-1].tensors_done == seen[-1].tensors_total == len(files[1])
    assert seen[-1].gflop_done == pytest.approx(seen[-1].gflop_total)
    assert [p.tensors_done for p in seen] == list(range(1, len(seen) + 1))


def test_sharded_checkpoint(files, tmp_path):
    paths, model, _, _ = files
    names = list(model)
    shard1 = ck.write(tmp_path / "m-00001.safetensors", {n: model[n] for n in names[:5]})
    shard2 = ck.write(tmp_path / "m-00002.safetensors", {n: model[n] for n in names[5:]})
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": "1"}, "weight_map": {
        **{n: shard1.name for n in names[:5]}, **{n: shard2.name for n in names[5:]}}}))
    ltx2blas.fuse_checkpoint(index, [(paths["a1"], 1.0)], tmp_path / "from_shards.safetensors")
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], paths["out"])
    a, _, _ = read_all(tmp_path / "from_shards.safetensors")
    b, _, _ = read_all(paths["out"])
    assert set(a) == set(b) and all(np.array_equal(a[n][1], b[n][1]) for n in a)
    # a missing shard, and a key in two shards: errors before anything is written
    os.rename(shard2, tmp_path / "gone")
    with pytest.raises(errors.Ltx2IOError, match="missing"):
        ltx2blas.fuse_checkpoint(index, [(paths["a1"], 1.0)], tmp_path / "x.safetensors")
    os.rename(tmp_path / "gone", shard2)
    ck.write(shard2, {n: model[n] for n in names[4:]})
    with pytest.raises(errors.FormatError, match="in two shards"):
        ltx2blas.fuse_checkpoint(index, [(paths["a1"], 1.0)], tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fp8_checkpoint(tmp_path, rng, rounding):
    model = ck.model(rng, fp8="F8_E4M3")
    ad = ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4)
    mp = ck.write(tmp_path / "fp8.safetensors", model)
    ap = ck.write(tmp_path / "a.safetensors", ad)
    out = tmp_path / "out.safetensors"
    ltx2blas.fuse_checkpoint(mp, [(ap, 1.0)], out, fp8_rounding=rounding, seed=3)
    got, meta, _ = read_all(out)
    name = M + "transformer_blocks.0.attn1.to_q.weight"
    q = "diffusion_model.transformer_blocks.0.attn1.to_q"
    expected = ltx2blas.fuse_loras(model[name][1], [(ad[q + ".lora_A.weight"][1], ad[q + ".lora_B.weight"][1], 1.0)],
                                   weight_format="F8_E4M3", fp8_rounding=rounding, seed=3, name=name)
    assert got[name][0] == "F8_E4M3" and np.array_equal(got[name][1], expected)
    assert meta["ltx2blas.fp8_rounding"].startswith(rounding)


def _overflow_case(tmp_path, rng):
    """An fp8 checkpoint and an adapter at a strength that takes about a tenth of to_q's
    values past 448; with the reference's expected count of them."""
    model = ck.model(rng, fp8="F8_E4M3")
    ad = ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4)
    name = M + "transformer_blocks.0.attn1.to_q.weight"
    q = "diffusion_model.transformer_blocks.0.attn1.to_q"
    pair = (ad[q + ".lora_A.weight"][1], ad[q + ".lora_B.weight"][1], 60000.0)
    summed = reference.bf16_widen(reference.bf16_round(
        reference.fp8_widen(model[name][1], "F8_E4M3") + reference.bf16_widen(reference.lora_delta(*pair))))
    past = int(np.sum(np.abs(summed) > 464))  # 464 itself ties down to 448
    assert 0.02 < past / summed.size < 0.5
    return (ck.write(tmp_path / "fp8.safetensors", model), ck.write(tmp_path / "a.safetensors", ad),
            model, name, pair, past)


@pytest.mark.parametrize("rule", ["saturate", "nan"])
def test_fp8_overflow_rule_in_a_checkpoint(tmp_path, rng, rule):
    mp, ap, model, name, pair, past = _overflow_case(tmp_path, rng)
    out = tmp_path / "out.safetensors"
    report = ltx2blas.fuse_checkpoint(mp, [(ap, pair[2])], out, fp8_overflow=rule)
    got, meta, _ = read_all(out)
    assert np.array_equal(got[name][1], reference.fuse_loras_fp8(model[name][1], [pair], "F8_E4M3",
                                                                 overflow=rule))
    assert meta["ltx2blas.fp8_overflow"].startswith(rule + ":")
    assert report.fp8_overflows == {name: past}
    made = "+-448" if rule == "saturate" else "NaN"
    assert (f"{past} fp8 values in 1 weight rounded past their format's largest finite value "
            f"(e.g. {past} in {name}): F8_E4M3 stores them as {made} (fp8_overflow='{rule}')"
            in report.summary())
    with pytest.raises(errors.NonFiniteResultError, match=rf"{name}: .*fp8_overflow='{rule}'"):
        ltx2blas.fuse_checkpoint(mp, [(ap, pair[2])], tmp_path / "no.safetensors",
                                 fp8_overflow=rule, check_finite=True)
    assert not (tmp_path / "no.safetensors").exists()
    state = {n: v.copy() for n, (_, v) in model.items()}
    report = ltx2blas.fuse_state_dict(state, [(ap, pair[2])], fp8_overflow=rule,
                                      weight_format="F8_E4M3")
    assert np.array_equal(state[name], got[name][1]) and report.fp8_overflows == {name: past}


def test_fp8_overflow_rule_is_checked_before_reading(tmp_path, rng):
    mp, ap, *_ = _overflow_case(tmp_path, rng)
    out = tmp_path / "out.safetensors"
    with pytest.raises(errors.ArgumentError, match="fp8_overflow must be"):
        ltx2blas.fuse_checkpoint(mp, [(ap, 1.0)], out, fp8_overflow="NaN")
    with pytest.raises(errors.ArgumentError, match="takes fp8_overflow='saturate'"):
        ltx2blas.fuse_checkpoint(mp, [(ap, 1.0)], out, fp8_overflow="nan",
                                 fp8_rounding="stochastic")
    assert not out.exists()
    report = ltx2blas.fuse_checkpoint(mp, [(ap, 1.0)], out)   # no overflow: nothing said
    assert report.fp8_overflows == {} and "rounded past" not in report.summary()


def test_state_dict_numpy_in_place(files, rng):
    paths, model, a1, _ = files
    state = {n: v.copy() for n, (_, v) in model.items()}
    report = ltx2blas.fuse_state_dict(state, [(paths["a1"], 0.8)])
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.8)], paths["out"])
    out, _, _ = read_all(paths["out"])
    assert report.modules_fused == 2
    assert all(np.array_equal(state[n].view(np.uint8), out[n][1].view(np.uint8)) for n in state)


def test_state_dict_torch_zero_copy(files):
    torch = pytest.importorskip("torch")
    paths, model, a1, _ = files
    state = {}
    for n, (dtype, v) in model.items():
        t = torch.from_numpy(v.astype(np.int16) if dtype == "BF16" else v.copy())
        state[n] = t.view(torch.bfloat16) if dtype == "BF16" else t
    name = M + "transformer_blocks.0.attn1.to_q.weight"
    pointer = state[name].data_ptr()
    adapter_state = {k: torch.from_numpy(v.astype(np.int16)).view(torch.bfloat16) for k, (_, v) in a1.items()}
    ltx2blas.fuse_state_dict(state, [(adapter_state, 0.8)])
    assert state[name].data_ptr() == pointer  # in place, no copy
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.8)], paths["out"])
    out, _, _ = read_all(paths["out"])
    assert np.array_equal(state[name].view(torch.int16).numpy().view(np.uint16), out[name][1])


def test_reader_reads_small_weights_ahead_while_a_large_one_is_written(tmp_path, rng):
    # Two large weights then four small ones; the first large one written (released), the
    # second still being written: the four small ones are read, with their factors, into the
    # bin the first one left -- not one at a time behind the second's write.
    shapes = [(64, 1024), (64, 1024)] + [(8, 1024)] * 4
    names = [f"w{i}" for i in range(len(shapes))]
    tensors = {n: ("BF16", rng.integers(0, 1 << 16, size=s, dtype=np.uint16)) for n, s in zip(names, shapes)}
    path = ck.write(tmp_path / "m.safetensors", tensors)
    shift = {n: (97 * i) % 4096 // 2 * 2 for i, n in enumerate(names)}  # odd places in a page
    loaded = []

    def load(name, space):
        space[:4] = 7  # the factors' place, after the weight
        loaded.append(name)
        return space[:4].copy()

    ckpt = checkpoint.Checkpoint(path)
    reader = checkpoint._Prefetcher(ckpt, names, load, lambda name: 4, shift.get)
    try:
        first, _ = reader.take("w0")
        second, _ = reader.take("w1")
        reader.release(first)
        got = {}

        def take_small():
            for n in names[2:]:
                got[n] = reader.take(n)

        worker = threading.Thread(target=take_small, daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "the small weights waited for the large one's write"
        assert loaded == names
        for n, (weight, factors) in got.items():
            assert np.array_equal(weight, tensors[n][1]) and np.array_equal(factors, [7] * 4)
            assert weight.ctypes.data % 4096 == shift[n]
            assert np.shares_memory(weight, reader.bins[0])
        assert np.array_equal(second, tensors["w1"][1])  # not overwritten by the reads ahead
    finally:
        reader.close()
        ckpt.close()


# ---- an IC-LoRA's own module; non-finite values named by file and tensor ----

SLOT = {"frequencies": (16,), "net.0.weight": (256, 33), "net.0.bias": (256,),
        "net.2.weight": (128, 256), "net.2.bias": (128,)}


def test_tensors_of_a_module_the_model_lacks_are_reported_and_left_out(files, tmp_path, rng):
    """Upstream's trainer saves an IC-LoRA's reference slot embedding (F32 tensors of a module
    of its own) beside the LoRA pairs. They change no weight of the model, a fused checkpoint
    holds only the model's tensors, and upstream's loader skips them too: they are left out and
    named, in the summary and in the output's record, and the pairs are fused."""
    paths, model, a1, _ = files
    ic = dict(a1)
    for name, shape in SLOT.items():
        ic["diffusion_model.reference_slot_embedding." + name] = (
            "F32", rng.standard_normal(shape).astype(np.float32))
    path = ck.write(tmp_path / "ic.safetensors", ic)
    report = ltx2blas.fuse_checkpoint(paths["model"], [(path, 1.0)], paths["out"])
    plain = ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)],
                                     tmp_path / "plain.safetensors")
    assert report.modules_fused == plain.modules_fused == 2
    out, meta, order = read_all(paths["out"])
    assert order == read_all(tmp_path / "plain.safetensors")[2]
    assert all(np.array_equal(v[1], read_all(tmp_path / "plain.safetensors")[0][n][1])
               for n, v in out.items())
    assert sorted(report.adapters[0].extra_tensors) == sorted(
        "diffusion_model.reference_slot_embedding." + n for n in SLOT)
    assert ("5 tensors of modules the model does not have were not fused "
            "(reference_slot_embedding)") in report.summary()
    (record,) = json.loads(meta["ltx2blas.fused"])
    assert len(record["not_fused"]) == 5


def test_an_ic_loras_run_time_settings_are_kept_and_named(files, tmp_path):
    """Upstream's IC-LoRA files say in their metadata how the reference video is prepared
    (reference_downscale_factor, reference_temporal_scale_factor), which its loader reads at run
    time: no weight holds them, so the fused file's record keeps them under the adapter (as
    stored, strings), and the summary says so; a state dict's fuse says the loader must apply
    them itself. An adapter without them records none."""
    paths, model, a1, a2 = files
    settings = {"reference_downscale_factor": "2", "reference_temporal_scale_factor": "1"}
    ic = ck.write(tmp_path / "ic.safetensors", a1, {**settings, "format": "pt"})
    report = ltx2blas.fuse_checkpoint(paths["model"], [(ic, 1.0), (paths["a2"], 0.5)],
                                      paths["out"])
    assert report.adapters[0].settings == settings and report.adapters[1].settings == {}
    _, meta, _ = read_all(paths["out"])
    first, second = json.loads(meta["ltx2blas.fused"])
    assert first["settings"] == settings and "settings" not in second
    line = report.summary().splitlines()[-2]
    assert line.startswith("adapter 0: ") and line.endswith(
        "its run-time settings (reference_downscale_factor=2, reference_temporal_scale_factor=1) "
        "are not in the weights: the output's metadata keeps them under this adapter in "
        "ltx2blas.fused, for the loader to read there")
    state = {n: v.copy() for n, (_, v) in model.items() if n.endswith(".weight")}
    report = ltx2blas.fuse_state_dict(state, [(ic, 1.0)])
    assert report.summary().endswith("the loader must apply them itself "
                                     "(report.adapters[0].settings)")


def test_keys_that_are_no_adapter_tensor_say_so(files, tmp_path):
    """A key of no adapter role that names one of the model's own modules (a full weight, an
    unknown role) is not skipped: it is refused, the message naming the keys plainly."""
    paths, model, a1, _ = files
    bad = dict(a1)
    bad["diffusion_model.transformer_blocks.0.attn1.to_q.weight"] = ("F32", np.zeros(3, np.float32))
    path = ck.write(tmp_path / "bad.safetensors", bad)
    with pytest.raises(errors.KeyMatchError) as err:
        ltx2blas.fuse_checkpoint(paths["model"], [(path, 1.0)], paths["out"])
    text = str(err.value)
    assert text.startswith(str(path) + ": 1 key is not a tensor of any adapter kind")
    assert "'diffusion_model.transformer_blocks.0.attn1.to_q.weight'" in text
    assert "match no weight" not in text and ": ;" not in text


@pytest.mark.parametrize("where", ["lora_A", "lora_B", "alpha"])
def test_non_finite_adapter_values_name_file_and_tensor(files, tmp_path, where):
    """An adapter tensor holding NaN or inf is refused as it is read, with or without
    check_finite, by a dry run too, naming the file, the tensor and the element; nothing is
    written."""
    paths, model, a1, _ = files
    bad = {k: (d, v.copy()) for k, (d, v) in a1.items()}
    key = "diffusion_model.transformer_blocks.0.ff.net.0.proj." + where + (
        "" if where == "alpha" else ".weight")
    if where == "alpha":
        bad[key] = ("F32", np.array(np.nan, np.float32))
    else:
        bad[key][1][1, 2] = 0x7F80  # +inf
    path = ck.write(tmp_path / "bad.safetensors", bad)
    for dry_run in (True, False):
        with pytest.raises(errors.NonFiniteInputError) as err:
            ltx2blas.fuse_checkpoint(paths["model"], [(path, 1.0)], paths["out"],
                                     dry_run=dry_run)
        text = str(err.value)
        assert text.startswith(f"{path}: ") and repr(key) in text
        assert ("is nan" in text) if where == "alpha" else ("holds inf at (1, 2)" in text)
        assert not paths["out"].exists()


def test_non_finite_weight_and_overflow_name_file_and_tensor(files, tmp_path):
    """Under check_finite a weight already non-finite names the model file and the tensor, in
    the real run and in a dry run; an overflowing result names both files and keys."""
    paths, model, a1, _ = files
    q = M + "transformer_blocks.0.attn1.to_q.weight"
    broken = {k: (d, v.copy()) for k, (d, v) in model.items()}
    broken[q][1][3, 5] = 0x7FC0
    base = ck.write(tmp_path / "broken.safetensors", broken)
    for dry_run in (True, False):
        with pytest.raises(errors.NonFiniteWeightError) as err:
            ltx2blas.fuse_checkpoint(base, [(paths["a1"], 1.0)], paths["out"], dry_run=dry_run,
                                     check_finite=True)
        assert str(err.value).startswith(f"{base}: {q}: weight (bf16) is already non-finite "
                                         "at (3, 5)")
    big = {k: (d, np.full_like(v, 0x7F00) if "lora_B" in k else v) for k, (d, v) in a1.items()}
    path = ck.write(tmp_path / "big.safetensors", big)
    with pytest.raises(errors.NonFiniteResultError) as err:
        ltx2blas.fuse_checkpoint(paths["model"], [(path, 100.0)], paths["out"], check_finite=True)
    text = str(err.value)
    assert text.startswith(f"{paths['model']}: {q}, adapter {path}: "
                           "diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight: ")
    assert not paths["out"].exists()
