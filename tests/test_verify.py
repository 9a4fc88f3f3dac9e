"""ltx2blas verify: a fused checkpoint checked against the provenance record it carries and
against its inputs, rebuilt; files of other tools and older records told apart from faults."""
import base64
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys

import blake3
import numpy as np
import pytest

import ltx2blas
from ltx2blas import fuse as fusemod
from ltx2blas.files import provenance
from ltx2blas.files import safetensors as st
from ltx2blas.files.safetensors import SafetensorsFile
from ltx2blas.files.verify import verify_checkpoint

import ckpt_helpers as ck

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
Q = "transformer_blocks.0.attn1.to_q"


@pytest.fixture
def files(tmp_path, rng):
    model = ck.model(rng)
    a1 = ck.adapter(rng, [Q, "transformer_blocks.0.ff.net.0.proj"], rank=8)
    a2 = ck.adapter(rng, [Q, "transformer_blocks.1.attn1.to_q"], rank=5, prefix="",
                    style="kohya", alpha=10.0)
    paths = {
        "model": ck.write(tmp_path / "model.safetensors", model, {"format": "pt"}),
        "a1": ck.write(tmp_path / "a1.safetensors", a1),
        "a2": ck.write(tmp_path / "a2.safetensors", a2),
        "out": tmp_path / "out.safetensors",
    }
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.8), (paths["a2"], -1.5)],
                             paths["out"], threads=2)
    return paths, model, a1, a2


def inputs(paths):
    return dict(model=paths["model"], loras=[(paths["a1"], 0.8), (paths["a2"], -1.5)])


def raw_digests(path, hash_name="sha256"):
    """Each tensor's SHA-256 (or BLAKE3), from the file's bytes at the offsets its header gives,
    read with plain file reads (not the code under test)."""
    new = hashlib.sha256 if hash_name == "sha256" else blake3.blake3
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    start = 8 + n
    return {name: new(data[start + e["data_offsets"][0]:start + e["data_offsets"][1]])
            .hexdigest() for name, e in header.items()}


def listed(digests):
    """A format 2 digest list of {tensor: hex digest}, made as docs/verify.md says (not by the
    code under test): the count, the BLAKE3 of the sorted names (each as its 8-byte
    little-endian length and UTF-8 bytes), the digests in that order packed in base64."""
    names = sorted(digests)
    h = blake3.blake3()
    for n in names:
        h.update(struct.pack("<Q", len(n.encode())) + n.encode())
    return {"count": len(names), "names": base64.b64encode(h.digest()).decode(),
            "digests": base64.b64encode(b"".join(bytes.fromhex(digests[n]) for n in names))
            .decode()}


def read_bits(names, read):
    """A format 2 record's "read": one bit (LSB first) per name of the sorted ``names``, set for
    those in ``read``, in base64."""
    bits = bytearray((len(names) + 7) // 8)
    for i, n in enumerate(sorted(names)):
        if n in read:
            bits[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(bits)).decode()


def as_format1(paths, out="out", loras=("a1", "a2")):
    """A change(metadata) that replaces the record of ``paths[out]`` (format 2) by the format 1
    record 0.1.0 would have written for it: SHA-256 of each tensor, names in full."""
    def change(metadata):
        rec = json.loads(metadata[provenance.RECORD_KEY])
        output, read = provenance.expand_output(rec, list(raw_digests(paths[out])))
        base = raw_digests(paths["model"])
        rec.update(format=1, output=raw_digests(paths[out]),
                   base={"file": rec["base"]["file"], "read": {n: base[n] for n in read}})
        del rec["hash"]
        for a, key in zip(rec["adapters"], loras):
            a["tensors"] = raw_digests(paths[key])
        metadata[provenance.RECORD_KEY] = json.dumps(rec, separators=(",", ":"))
    return change


def flip_byte(path, tensor, at=3):
    """Change one byte of ``tensor``'s data in place (its header untouched)."""
    with SafetensorsFile(path) as f:
        offset = f.tensors[tensor].begin + at
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def record_of(path):
    with SafetensorsFile(path) as f:
        return json.loads(f.metadata[provenance.RECORD_KEY])


def whats(report):
    return {(f.what, f.tensor) for f in report.findings}


def test_the_record_holds_the_inputs_outputs_and_options(files):
    paths, model, a1, a2 = files
    rec = record_of(paths["out"])
    assert rec["contract"] == provenance.CONTRACT and rec["format"] == provenance.RECORD_FORMAT
    assert rec["format"] == 2 and rec["hash"] == "blake3"
    assert rec["options"] == {"rule": "addmm", "alpha": "scale", "allow_unmatched": False,
                              "fp8_rounding": "nearest", "seed": 0, "fp8_overflow": "saturate"}
    # every tensor written, as the file's bytes hash, in the order of the sorted names
    out = raw_digests(paths["out"], "blake3")
    assert rec["output"] == listed(out)
    base = raw_digests(paths["model"], "blake3")
    changed = sorted(M + m + s for m in (Q, "transformer_blocks.0.ff.net.0.proj",
                                         "transformer_blocks.1.attn1.to_q") for s in (".weight",))
    # the base's tensors read to compute the fused ones: one bit each in the output's order,
    # and no digest of their base bytes (a rebuild checks those)
    assert rec["base"] == {"file": "model.safetensors", "read": read_bits(out, changed)}
    # every copied tensor is the base's: its output digest is its base digest
    assert all(out[n] == base[n] for n in base if n not in changed)
    assert [(a["file"], a["strength"]) for a in rec["adapters"]] == [("a1.safetensors", 0.8),
                                                                     ("a2.safetensors", -1.5)]
    for a, path in zip(rec["adapters"], (paths["a1"], paths["a2"])):
        # the adapter file whole by SHA-256 (as Hugging Face shows it), its tensors by BLAKE3
        assert a["tensors"] == listed(raw_digests(path, "blake3"))
        assert a["sha256"] == hashlib.sha256(open(path, "rb").read()).hexdigest()
    # no tensor name is stored in the record
    assert all(n not in json.dumps(rec) for n in out)


def test_an_untouched_output_verifies_alone_and_against_its_inputs(files):
    paths = files[0]
    alone = verify_checkpoint(paths["out"])
    assert alone.status == "verified" and alone.exit_code == 0 and not alone.findings
    assert alone.tensors_hashed == len(raw_digests(paths["out"]))
    full = verify_checkpoint(paths["out"], **inputs(paths), threads=1)
    assert full.status == "verified", full.summary()
    assert full.tensors_rebuilt == 3 and full.inputs_hashed > 0
    # strengths left out are the record's
    bare = verify_checkpoint(paths["out"], paths["model"], [paths["a1"], paths["a2"]])
    assert bare.status == "verified", bare.summary()


def test_other_thread_counts_tiles_and_kernels_make_the_same_file(files, monkeypatch, tmp_path):
    """The record names no thread count or tile: a fuse on one thread, with small tiles and the
    other fuse kernel gives the same file, which verifies."""
    paths = files[0]
    other = tmp_path / "other.safetensors"
    monkeypatch.setattr(fusemod, "default_tile", lambda rows, cols: fusemod.Tile(16, 8))
    fusemod.use_fuse_kernel("fma")
    try:
        ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.8), (paths["a2"], -1.5)],
                                 other, threads=1)
    finally:
        fusemod.use_fuse_kernel(None)
    assert open(other, "rb").read() == open(paths["out"], "rb").read()
    assert verify_checkpoint(other, **inputs(paths), threads=2).status == "verified"


def test_a_changed_byte_of_a_fused_tensor_is_named(files):
    paths = files[0]
    flip_byte(paths["out"], M + Q + ".weight")
    alone = verify_checkpoint(paths["out"])
    assert alone.status == "differs" and alone.exit_code == 1
    assert whats(alone) == {("digest", M + Q + ".weight")}
    full = verify_checkpoint(paths["out"], **inputs(paths))
    assert ("rebuilt", M + Q + ".weight") in whats(full)
    rebuilt = next(f for f in full.findings if f.what == "rebuilt")
    assert (rebuilt.count, rebuilt.first) == (1, 1)  # byte 3 is element 1's high byte


def test_a_changed_copied_tensor_is_named(files):
    paths = files[0]
    flip_byte(paths["out"], M + "norm_out.weight")
    report = verify_checkpoint(paths["out"])
    assert whats(report) == {("digest", M + "norm_out.weight")}


def test_a_changed_base_tensor_is_named(files):
    """A base tensor fused from differs from its recorded digest: the base is named.  A copied
    one that differs from the file's, whose record agrees with the file, is the file's tensor
    named as not the base's: the digests cannot tell a changed base from a file edited with
    its record, and the file is what is verified (both causes are said)."""
    paths = files[0]
    for tensor, what in ((M + Q + ".weight", "base"), ("vae.decoder.conv.weight", "copied")):
        shutil.copy(paths["model"], paths["model"].with_suffix(".orig"))
        flip_byte(paths["model"], tensor)
        report = verify_checkpoint(paths["out"], **inputs(paths))
        assert report.status == "differs"
        assert (what, tensor) in whats(report), report.summary()
        shutil.copy(paths["model"].with_suffix(".orig"), paths["model"])
    # the file itself is intact
    assert verify_checkpoint(paths["out"]).status == "verified"


def test_a_fuse_hashes_each_output_byte_once_and_no_base_byte(files, tmp_path, monkeypatch):
    """The digests' cost is one hash of each byte written: the base's bytes a fuse computes
    from are not hashed (the rebuild checks them), a copied tensor is hashed once."""
    paths = files[0]
    fed = []
    add, add_file, now = (provenance.Hasher.add, provenance.Hasher.add_file,
                          provenance.Hasher.hash_now)

    def counted(method, size):
        def wrapper(self, name, *args, **kwargs):
            fed.append(size(*args))
            return method(self, name, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(provenance.Hasher, "add",
                        counted(add, lambda data, *_, **__: memoryview(data).nbytes))
    monkeypatch.setattr(provenance.Hasher, "add_file",
                        counted(add_file, lambda f, info: info.nbytes))
    monkeypatch.setattr(provenance.Hasher, "hash_now",
                        counted(now, lambda data: memoryview(data).nbytes))
    out = tmp_path / "again.safetensors"
    ltx2blas.fuse_checkpoint(paths["model"], inputs(paths)["loras"], out, threads=2)
    with SafetensorsFile(out) as f:
        written = sum(info.nbytes for info in f.tensors.values())
    assert sum(fed) == written


def test_the_base_alone_checks_the_copied_tensors_and_says_what_needs_the_adapters(files):
    """A format 2 record keeps no digest of the base's bytes a fuse computed from: the base
    alone is checked on the tensors copied, and the report says the rest needs the adapters;
    with them, a changed base weight is named as the base's (the file and adapters are as
    recorded, so the base is the input left)."""
    paths = files[0]
    alone = verify_checkpoint(paths["out"], model=paths["model"])
    assert alone.status == "verified", alone.summary()
    assert "the 3 tensors the fuse computed from the base" in alone.summary()
    assert "give the adapters (--lora) too" in alone.summary()
    flip_byte(paths["model"], M + "norm_out.weight")
    copied = verify_checkpoint(paths["out"], model=paths["model"])
    assert ("copied", M + "norm_out.weight") in whats(copied)
    flip_byte(paths["model"], M + "norm_out.weight")
    flip_byte(paths["model"], M + Q + ".weight")
    unseen = verify_checkpoint(paths["out"], model=paths["model"])
    assert unseen.status == "verified"  # the weight fused is not the base alone's to check
    full = verify_checkpoint(paths["out"], **inputs(paths), threads=1)
    assert full.status == "differs" and full.cause_class == "base", full.summary()
    assert full.findings[0].what == "base" and full.findings[0].tensor == M + Q + ".weight"
    assert "not the tensor fused" in full.summary().splitlines()[0]


def test_a_changed_adapter_tensor_is_named(files):
    paths = files[0]
    key = "diffusion_model." + Q + ".lora_B.weight"
    flip_byte(paths["a1"], key)
    report = verify_checkpoint(paths["out"], **inputs(paths))
    assert report.status == "differs"
    assert ("adapter 0", key) in whats(report)
    assert ("rebuilt", M + Q + ".weight") in whats(report)


def test_a_different_strength_or_rule_fails(files):
    paths = files[0]
    report = verify_checkpoint(paths["out"], paths["model"],
                               [(paths["a1"], 0.8), (paths["a2"], -1.25)])
    assert report.status == "differs"
    assert ("strength", "") in whats(report)
    assert ("rebuilt", M + Q + ".weight") in whats(report)
    assert ("rebuilt", M + "transformer_blocks.0.ff.net.0.proj.weight") not in whats(report)
    report = verify_checkpoint(paths["out"], **inputs(paths), rule="sum")
    assert report.status == "differs" and ("option", "") in whats(report)
    assert "rule 'sum' given" in report.summary()


def test_adapters_in_another_order_are_named_as_such(files):
    paths = files[0]
    report = verify_checkpoint(paths["out"], paths["model"], [(paths["a2"], -1.5),
                                                              (paths["a1"], 0.8)])
    assert report.status == "differs"
    assert [f.what for f in report.findings if f.what == "order"] == ["order", "order"]
    assert "another order" in report.summary()


def test_a_truncated_file_is_malformed(files):
    paths = files[0]
    size = os.path.getsize(paths["out"])
    os.truncate(paths["out"], size - 10)
    with pytest.raises(ltx2blas.FormatError):
        verify_checkpoint(paths["out"])
    r = run_cli("verify", str(paths["out"]))
    assert r.returncode == 3 and "truncated" in r.stderr


def test_a_file_without_digests_is_not_called_a_mismatch(files, tmp_path):
    """A file fused without a record (as ltx2blas fused before records) cannot be checked alone;
    against its inputs its rebuild is compared."""
    paths = files[0]
    old = tmp_path / "old.safetensors"
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.8), (paths["a2"], -1.5)], old,
                             digests=False)
    with SafetensorsFile(old) as f:
        assert provenance.RECORD_KEY not in f.metadata and "ltx2blas.fused" in f.metadata
    alone = verify_checkpoint(old)
    assert alone.status == "unverifiable" and alone.exit_code == 6
    assert "without a record" in alone.origin
    assert verify_checkpoint(old, **inputs(paths)).status == "verified"
    # a rebuild that differs is not proof of a fault: its contract is not known
    differs = verify_checkpoint(old, paths["model"], [(paths["a1"], 0.5), (paths["a2"], -1.5)])
    assert differs.status == "unverifiable" and differs.findings


def rewrite_metadata(src, dst, change):
    """Copy a safetensors file with its metadata changed by ``change(dict)``, byte by byte: the
    header's JSON rewritten (padded with spaces to 8 bytes, as writers do), the data as it
    was."""
    data = open(src, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    change(metadata)
    text = json.dumps({"__metadata__": metadata, **header}).encode()
    text += b" " * (-len(text) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])


def test_a_record_of_another_contract_is_reported_as_such(files, tmp_path):
    paths = files[0]
    other = tmp_path / "other.safetensors"

    def older(metadata):
        rec = json.loads(metadata[provenance.RECORD_KEY])
        rec["contract"] = provenance.CONTRACT + 1
        metadata[provenance.RECORD_KEY] = json.dumps(rec)

    rewrite_metadata(paths["out"], other, older)
    report = verify_checkpoint(other, **inputs(paths))
    assert report.status == "unverifiable" and report.exit_code == 6
    assert f"contract {provenance.CONTRACT + 1}" in report.summary()
    assert report.tensors_hashed and not report.tensors_rebuilt


def fused_elsewhere(paths, model, a1, a2, dst, matmul):
    """The fuse as another tool computes it: upstream's rule (docs/arithmetic.md §1, addmm for
    two adapters on one weight), with each product's f32 sums in ``matmul``'s order."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    tensors = dict(model)

    def f32(bits):
        return bits.view(bf16).astype(np.float32)

    def rounded(x):
        return x.astype(bf16).astype(np.float32)

    def delta(a, b, s):
        return rounded(matmul(rounded(f32(b) * np.float32(s)), f32(a)))

    def fuse(name, agg):
        tensors[name] = ("BF16", (f32(tensors[name][1]) + agg).astype(bf16).view(np.uint16))

    p1, s2 = "diffusion_model.", np.float32(-1.5 * 10 / 5)
    first = delta(a1[p1 + Q + ".lora_A.weight"][1], a1[p1 + Q + ".lora_B.weight"][1], 0.8)
    fuse(M + Q + ".weight", rounded(first + s2 * matmul(f32(a2[Q + ".lora_up.weight"][1]),
                                                        f32(a2[Q + ".lora_down.weight"][1]))))
    ff = "transformer_blocks.0.ff.net.0.proj"
    fuse(M + ff + ".weight", delta(a1[p1 + ff + ".lora_A.weight"][1],
                                   a1[p1 + ff + ".lora_B.weight"][1], 0.8))
    q1 = "transformer_blocks.1.attn1.to_q"
    fuse(M + q1 + ".weight", delta(a2[q1 + ".lora_down.weight"][1], a2[q1 + ".lora_up.weight"][1],
                                   s2))
    return ck.write(dst, tensors)


def reversed_order(b, a):
    """f32 sums over the rank from the last term to the first: another BLAS's order."""
    acc = np.zeros((b.shape[0], a.shape[1]), np.float32)
    for k in reversed(range(b.shape[1])):
        acc = acc + b[:, k:k + 1] * a[k:k + 1, :]
    return acc


def test_another_tools_file_is_compared_with_the_base_and_ltx2blas(files, tmp_path):
    paths, model, a1, a2 = files
    other = fused_elsewhere(paths, model, a1, a2, tmp_path / "other.safetensors", reversed_order)
    alone = verify_checkpoint(other)
    assert alone.status == "unverifiable" and alone.origin == "no ltx2blas record"
    report = verify_checkpoint(other, **inputs(paths))
    assert report.tensors_rebuilt == 3
    assert report.equal_ltx2blas + report.unlike_both == 3 and report.equal_base == 0
    # summing in another order moves a few values by a step or two, never more
    for f in report.findings:
        assert f.what == "unlike both" and 0 < f.steps <= 2 and f.count > 0
    assert report.status == ("differs" if report.unlike_both else "verified")


def test_the_unchanged_base_is_reported_as_holding_no_adapter(files):
    paths = files[0]
    report = verify_checkpoint(paths["model"], **inputs(paths))
    assert report.status == "differs" and report.equal_base == 3
    assert {f.what for f in report.findings} == {"equals the base"}
    assert "3 equal the base (no adapter in them)" in report.summary()


def test_a_strength_that_explains_another_file_is_named(files, tmp_path):
    """A file fused at half the strength: each weight differs from both, and the fit says 0.5."""
    paths, model, a1, a2 = files
    half = tmp_path / "half.safetensors"
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.4), (paths["a2"], -0.75)], half,
                             digests=False)
    with SafetensorsFile(half) as f:
        metadata = {k: v for k, v in f.metadata.items() if not k.startswith("ltx2blas")}
    rewrite_metadata(half, half, lambda m: (m.clear(), m.update(metadata)))
    report = verify_checkpoint(half, **inputs(paths))
    assert report.status == "differs" and report.unlike_both == 3
    assert len(report.fits) == 3, report.fits
    assert all(abs(fit["multiple"] - 0.5) < 0.005 for fit in report.fits), report.fits


def test_torch_with_upstreams_arithmetic_is_another_tools_file(files, tmp_path):
    """A file fused in torch as upstream LTX-2 fuses (tests/upstream_rules.py): its BLAS sums
    in its own order, so a few values of each weight may differ from the textbook's by a
    step; none equals the base."""
    pytest.importorskip("torch", reason="the upstream fuse is written in torch")
    import upstream_rules as up

    paths, model, a1, a2 = files
    tensors = dict(model)
    s2 = -1.5 * 10 / 5
    p1 = "diffusion_model."
    ff, q1 = "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.1.attn1.to_q"
    for name, adapters in (
            (Q, [(a1[p1 + Q + ".lora_A.weight"][1], a1[p1 + Q + ".lora_B.weight"][1], 0.8),
                 (a2[Q + ".lora_down.weight"][1], a2[Q + ".lora_up.weight"][1], s2)]),
            (ff, [(a1[p1 + ff + ".lora_A.weight"][1], a1[p1 + ff + ".lora_B.weight"][1], 0.8)]),
            (q1, [(a2[q1 + ".lora_down.weight"][1], a2[q1 + ".lora_up.weight"][1], s2)])):
        key = M + name + ".weight"
        tensors[key] = ("BF16", up.bits(up.fuse_bf16(tensors[key][1],
                                                     up.aggregate(adapters, "addmm"))))
    other = ck.write(tmp_path / "torch.safetensors", tensors)
    report = verify_checkpoint(other, **inputs(paths))
    assert report.equal_base == 0 and report.equal_ltx2blas + report.unlike_both == 3
    assert all(f.what == "unlike both" and f.steps <= 2 for f in report.findings), \
        report.summary()


def test_progress_is_told_for_each_tensor(files):
    paths = files[0]
    seen = []
    verify_checkpoint(paths["out"], **inputs(paths), progress=seen.append)
    hashed = [p for p in seen if p.gflop_total == 0]
    rebuilt = [p for p in seen if p.gflop_total > 0]
    # the three fused weights rebuilt first, then the other seven tensors hashed: a tensor
    # compared with its rebuild needs no digest
    assert [p.tensors_done for p in rebuilt] == [1, 2, 3] and rebuilt[-1].fraction == 1.0
    assert [(p.tensors_done, p.tensors_total) for p in hashed] == [(i, 7) for i in range(1, 8)]
    assert len(raw_digests(paths["out"])) == 10


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ltx2blas", *args], capture_output=True,
                          text=True, cwd="/")


def test_the_command_exits_by_what_it_found(files):
    paths = files[0]
    ok = run_cli("verify", str(paths["out"]), "--model", str(paths["model"]),
                 "--lora", f"{paths['a1']}:0.8", "--lora", str(paths["a2"]))
    assert ok.returncode == 0 and ok.stdout.startswith("verified: "), ok.stderr
    js = run_cli("verify", str(paths["out"]), "--json")
    assert js.returncode == 0 and json.loads(js.stdout)["status"] == "verified"
    unknown = run_cli("verify", str(paths["model"]))
    assert unknown.returncode == 6 and unknown.stdout.startswith("cannot verify: ")
    flip_byte(paths["out"], M + Q + ".weight")
    bad = run_cli("verify", str(paths["out"]), "--json")
    assert bad.returncode == 1
    found = json.loads(bad.stdout)
    assert found["status"] == "differs"
    assert [(f["what"], f["tensor"]) for f in found["findings"]] == [("digest", M + Q + ".weight")]


def test_an_fp8_checkpoint_verifies_and_a_changed_code_is_counted_in_steps(tmp_path, rng):
    model = ck.model(rng, fp8="F8_E4M3")
    a1 = ck.adapter(rng, [Q], rank=4)
    paths = {"model": ck.write(tmp_path / "model.safetensors", model),
             "a1": ck.write(tmp_path / "a1.safetensors", a1)}
    out = tmp_path / "out.safetensors"
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], out)
    assert verify_checkpoint(out, paths["model"], [paths["a1"]]).status == "verified"
    # the base's copy as another tool's "fused" file: Q's codes moved by the adapter are counted
    report = verify_checkpoint(paths["model"], paths["model"], [paths["a1"]])
    assert report.equal_base == 1 and report.status == "differs"


def test_the_base_alone_or_the_adapters_alone_are_checked_against_the_record(files):
    paths = files[0]
    assert verify_checkpoint(paths["out"], model=paths["model"]).status == "verified"
    assert verify_checkpoint(paths["out"], loras=[paths["a1"], paths["a2"]]).status == "verified"
    flip_byte(paths["a2"], "transformer_blocks.1.attn1.to_q.lora_up.weight")
    report = verify_checkpoint(paths["out"], loras=[paths["a1"], paths["a2"]])
    assert whats(report) == {("adapter", ""),
                             ("adapter 1", "transformer_blocks.1.attn1.to_q.lora_up.weight")}
    assert report.tensors_rebuilt == 0


def test_the_fuse_command_can_leave_the_digests_out(files, tmp_path):
    paths = files[0]
    out = tmp_path / "plain.safetensors"
    r = run_cli("fuse", str(paths["model"]), "--lora", f"{paths['a1']}:0.8", "--lora",
                f"{paths['a2']}:-1.5", "-o", str(out), "--no-digests", "-q")
    assert r.returncode == 0, r.stderr
    with SafetensorsFile(out) as f:
        assert provenance.RECORD_KEY not in f.metadata
    assert run_cli("verify", str(out)).returncode == 6
    assert run_cli("verify", str(out), "--model", str(paths["model"]), "--lora",
                   f"{paths['a1']}:0.8", "--lora", f"{paths['a2']}:-1.5").returncode == 0


@pytest.mark.parametrize("change", [
    lambda rec: rec.update(options={**rec["options"], "rule": "max"}),
    lambda rec: rec["adapters"][0].update(strength="0.8"),
    lambda rec: rec["adapters"][0].update(tensors=[]),
    lambda rec: rec["output"].update(count="10"),
    lambda rec: rec["base"].update(read=7),
    lambda rec: rec.update(hash="md5"),
    lambda rec: rec.pop("base"),
    lambda rec: rec.update(options={**rec["options"], "seed": True}),
])
def test_a_malformed_record_is_named_not_trusted(files, tmp_path, change):
    """The record is the file's to write: a field of the wrong type or an unknown option makes
    it a record this ltx2blas cannot read (exit 6), never a crash or a rebuild by its values."""
    paths = files[0]
    bad = tmp_path / "bad.safetensors"

    def edit(metadata):
        rec = json.loads(metadata[provenance.RECORD_KEY])
        change(rec)
        metadata[provenance.RECORD_KEY] = json.dumps(rec)

    rewrite_metadata(paths["out"], bad, edit)
    report = verify_checkpoint(bad)
    assert report.status == "unverifiable" and "not a record this ltx2blas reads" in report.summary()
    r = run_cli("verify", str(bad))
    assert r.returncode == 6 and "not a record" in r.stdout


def test_the_command_reports_progress_of_each_step(files):
    """On a pipe: the rebuild's lines in GFLOP, then the hashing's in tensors, each step
    logged from its start to 100 %."""
    paths = files[0]
    r = run_cli("verify", str(paths["out"]), "--model", str(paths["model"]), "--lora",
                str(paths["a1"]), "--lora", str(paths["a2"]))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("ltx2blas: ")]
    rebuild = [line for line in lines if "GFLOP" in line]
    hashing = [line for line in lines if "GFLOP" not in line]
    assert rebuild and hashing and lines == rebuild + hashing
    assert rebuild[-1].startswith("ltx2blas: 100% 3/3 tensors")
    # the hashing's share is of its bytes, its rate in GB/s
    assert " 1/7 tensors  " in hashing[0] and all("GB/s" in line for line in hashing)
    assert hashing[-1].startswith("ltx2blas: 100% 7/7 tensors")


def test_a_sharded_base_verifies_what_its_single_file_made(files, tmp_path):
    """Digests are per tensor: the same tensors split into shards are the same base."""
    paths, model = files[0], files[1]
    names = list(model)
    shard1 = ck.write(tmp_path / "m-00001.safetensors", {n: model[n] for n in names[:5]})
    shard2 = ck.write(tmp_path / "m-00002.safetensors", {n: model[n] for n in names[5:]})
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {**{n: shard1.name for n in names[:5]},
                                                **{n: shard2.name for n in names[5:]}}}))
    report = verify_checkpoint(paths["out"], index, [(paths["a1"], 0.8), (paths["a2"], -1.5)])
    assert report.status == "verified", report.summary()
    flip_byte(shard2, names[7])  # a copied tensor: the file's is named as not the base's
    report = verify_checkpoint(paths["out"], index, [(paths["a1"], 0.8), (paths["a2"], -1.5)])
    assert ("copied", names[7]) in whats(report)
    assert "m.safetensors.index.json is not the base fused" in report.summary()


def test_stochastic_fp8_rounding_is_rebuilt_from_its_recorded_seed(tmp_path, rng):
    model = ck.model(rng, fp8="F8_E4M3")
    paths = {"model": ck.write(tmp_path / "model.safetensors", model),
             "a1": ck.write(tmp_path / "a1.safetensors", ck.adapter(rng, [Q], rank=4))}
    out = tmp_path / "out.safetensors"
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 1.0)], out,
                             fp8_rounding="stochastic", seed=7)
    assert record_of(out)["options"]["seed"] == 7
    assert verify_checkpoint(out, paths["model"], [paths["a1"]]).status == "verified"
    # the same file claimed to be rounded to nearest: the rebuild differs
    other = tmp_path / "nearest.safetensors"

    def nearest(metadata):
        rec = json.loads(metadata[provenance.RECORD_KEY])
        rec["options"]["fp8_rounding"] = "nearest"
        metadata[provenance.RECORD_KEY] = json.dumps(rec)

    rewrite_metadata(out, other, nearest)
    report = verify_checkpoint(other, paths["model"], [paths["a1"]])
    assert report.status == "differs" and ("rebuilt", M + Q + ".weight") in whats(report)


def test_a_base_with_a_tensor_more_is_not_the_base_recorded(files, tmp_path):
    paths, model = files[0], files[1]
    more = ck.write(tmp_path / "more.safetensors",
                    {**model, "extra.weight": ("F32", np.zeros(4, np.float32))})
    report = verify_checkpoint(paths["out"], model=more)
    assert report.status == "differs" and whats(report) == {("base", "extra.weight")}


def test_a_digest_that_went_missing_fails_the_fuse_and_writes_nothing(files, tmp_path,
                                                                       monkeypatch):
    """Were a digest lost (a hashing thread's fault), the record would name a placeholder as
    the tensor's digest; the fuse fails instead, and leaves no file."""
    paths = files[0]
    digests = st.SafetensorsWriter.digests
    monkeypatch.setattr(st.SafetensorsWriter, "digests", lambda self: {
        n: d for n, d in digests(self).items() if not n.endswith(".bias")})  # one lost
    out = tmp_path / "lost.safetensors"
    model = ck.write(tmp_path / "biased.safetensors", {
        **files[1], M + Q + ".bias": files[1][M + Q + ".bias"]})
    bias_adapter = ck.write(tmp_path / "b.safetensors", {
        **files[2], "diffusion_model." + Q + ".lora_B.bias": ("BF16", np.zeros(64, np.uint16))})
    with pytest.raises(RuntimeError, match="no digest for tensor"):
        ltx2blas.fuse_checkpoint(model, [(bias_adapter, 1.0)], out)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if "lost" in p]
