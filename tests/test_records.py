"""A fused file's record and history are the file's to write: deep, huge or non-finite values in
them end as "not a record this ltx2blas reads" (or a FormatError where a fuse would append to
them), never a traceback; what they hold is printed escaped; an output carries no record but
its own; verify's listings stay bounded, and a copied tensor edited with its record digest is
named in the file, not in the base."""
import json

import pytest

import ltx2blas
from ltx2blas.files import provenance
from ltx2blas.files.safetensors import SafetensorsFile
from ltx2blas.files.verify import NAMED, verify_checkpoint

from test_verify import (M, Q, as_format1, files, flip_byte, inputs,  # noqa: F401 (fixture)
                         listed, raw_digests, record_of, rewrite_metadata, run_cli, whats)

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

FUSED_KEY = "ltx2blas.fused"
#: nested far past Python's recursion limit (1000): json.loads raises RecursionError on it
DEEP = "[" * 100_000 + "]" * 100_000


def edited(paths, tmp_path, change, name="edited.safetensors"):
    """A copy of the fused output with its metadata changed by ``change(dict)``, its record
    first made the format 1 record of 0.1.0 (which names every tensor, so that records
    naming tensors the file lacks can be made; still read)."""
    out = tmp_path / name

    def both(metadata):
        as_format1(paths)(metadata)
        change(metadata)

    rewrite_metadata(paths["out"], out, both)
    return out


def set_record(change):
    def edit(metadata):
        rec = json.loads(metadata[provenance.RECORD_KEY])
        change(rec)
        metadata[provenance.RECORD_KEY] = json.dumps(rec)
    return edit


def not_a_record(report):
    return "is not a record this ltx2blas reads" in report.summary()


# -- records and histories that are not read ---------------------------------------------------

@pytest.mark.parametrize("whole", [True, False])
def test_a_record_nested_too_deep_is_not_a_record(files, tmp_path, whole):
    """Alone, with the base, with the adapters, with both: a report saying the record is not
    read (exit 6 alone), the record nested 100,000 deep or a record with such a field."""
    paths = files[0]

    def edit(metadata):
        text = metadata[provenance.RECORD_KEY]
        metadata[provenance.RECORD_KEY] = DEEP if whole else text[:-1] + ',"x":' + DEEP + "}"

    bad = edited(paths, tmp_path, edit)
    alone = verify_checkpoint(bad)
    assert alone.status == "unverifiable" and alone.exit_code == 6 and not_a_record(alone)
    for kwargs in (inputs(paths), {"model": paths["model"]}, {"loras": [paths["a1"]]}):
        report = verify_checkpoint(bad, **kwargs)
        assert not_a_record(report), report.summary()
    # the correct fuse, compared as a file without a record: its rebuild matches
    assert verify_checkpoint(bad, **inputs(paths)).status == "verified"


def test_a_history_nested_too_deep_is_named_by_verify_and_refused_by_a_fuse(files, tmp_path):
    paths = files[0]
    bad = edited(paths, tmp_path, lambda m: m.update({FUSED_KEY: DEEP}))
    report = verify_checkpoint(bad)
    assert report.status == "verified"  # its record is intact: the history does not count
    assert "ltx2blas.fused entry is not a history of fuses this ltx2blas reads" in \
        report.summary()
    assert verify_checkpoint(bad, **inputs(paths)).status == "verified"
    # a fuse appending to it would write a history that is not the file's: malformed input
    out = tmp_path / "again.safetensors"
    with pytest.raises(ltx2blas.FormatError, match="ltx2blas.fused entry is not a history"):
        ltx2blas.fuse_checkpoint(bad, [(paths["a1"], 0.5)], out, force=True)
    assert not out.exists()


def test_the_commands_exit_by_what_a_deep_entry_is(files, tmp_path):
    paths = files[0]
    both = edited(paths, tmp_path, lambda m: m.update({provenance.RECORD_KEY: DEEP,
                                                       FUSED_KEY: DEEP}))
    r = run_cli("verify", str(both))
    assert r.returncode == 6 and "not a record this ltx2blas reads" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("verify", str(both), "--model", str(paths["model"]), "--lora",
                f"{paths['a1']}:0.8", "--lora", f"{paths['a2']}:-1.5")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = tmp_path / "again.safetensors"
    r = run_cli("fuse", str(both), "--lora", str(paths["a1"]), "-o", str(out), "--force", "-q")
    assert r.returncode == 3 and "ltx2blas.fused entry is not a history" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


@pytest.mark.parametrize("strength", ["1" + "0" * 400, "1e39", "-1e39", "NaN", "Infinity"])
def test_a_strength_not_finite_as_f32_makes_the_record_unread(files, tmp_path, strength):
    """A 401-digit integer, 1e39, NaN: the record's fault (not a record), never an overflow
    or the adapter blamed for non-finite values (exit 5)."""
    paths = files[0]

    def edit(metadata):
        text = metadata[provenance.RECORD_KEY]
        assert '"strength":0.8' in text
        metadata[provenance.RECORD_KEY] = text.replace('"strength":0.8', f'"strength":{strength}')

    bad = edited(paths, tmp_path, edit)
    assert not_a_record(verify_checkpoint(bad))
    # the strengths left to the record, and one given
    for loras in ([paths["a1"], paths["a2"]], [(paths["a1"], 1.0)]):
        for model in (paths["model"], None):
            report = verify_checkpoint(bad, model, loras)
            assert not_a_record(report) and report.status in ("unverifiable", "differs")
    if strength.startswith("1000"):  # the command too, once
        r = run_cli("verify", str(bad), "--lora", f"{paths['a1']}:1.0")
        assert r.returncode == 6 and "not a record" in r.stdout, r.stderr


@pytest.mark.parametrize("change", [
    lambda rec: rec.update(format=True),
    lambda rec: rec.update(contract=10 ** 4000),
    lambda rec: rec.update(format=0),
])
def test_a_record_version_that_is_not_a_small_number_is_not_read(files, tmp_path, change):
    paths = files[0]
    bad = edited(paths, tmp_path, set_record(change))
    report = verify_checkpoint(bad)
    assert report.status == "unverifiable" and not_a_record(report)
    assert len(report.summary()) < 2000


# -- what the summary prints -------------------------------------------------------------------

FORGED = "1.0\x1b[2J\x1b[H\nverified: all good\r"


def test_an_escape_in_the_records_version_is_printed_escaped(files, tmp_path):
    paths = files[0]
    bad = edited(paths, tmp_path, set_record(lambda rec: rec.update(ltx2blas=FORGED)))
    report = verify_checkpoint(bad)
    assert report.status == "verified"
    text = report.summary()
    assert "\x1b" not in text and "\r" not in text
    assert not any(line.startswith("verified: all good") for line in text.splitlines())
    assert "\\x1b[2J" in text.splitlines()[0]
    r = run_cli("verify", str(bad))
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\r" not in r.stdout
    assert len(r.stdout.splitlines()) == len(text.splitlines())


def test_an_escape_in_the_version_of_a_file_without_a_record_is_printed_escaped(files, tmp_path):
    paths = files[0]

    def edit(metadata):
        del metadata[provenance.RECORD_KEY]
        metadata["ltx2blas.version"] = FORGED

    bad = edited(paths, tmp_path, edit)
    text = verify_checkpoint(bad).summary()
    assert "without a record" in text.splitlines()[0]
    assert "\x1b" not in text and "\r" not in text
    assert not any(line.startswith("verified: all good") for line in text.splitlines())


def test_a_long_version_is_cut_short(files, tmp_path):
    paths = files[0]
    bad = edited(paths, tmp_path, set_record(lambda rec: rec.update(ltx2blas="9" * 100_000)))
    report = verify_checkpoint(bad)
    assert report.status == "verified" and len(report.summary()) < 1000


# -- the output's record is its own ----------------------------------------------------------

def test_a_fuse_without_digests_leaves_out_the_bases_record(files, tmp_path):
    """Fused again with --force --no-digests: the output carries no record (the base's named
    other tensors), and verifies against its true inputs by its rebuild."""
    paths = files[0]
    again = tmp_path / "again.safetensors"
    ltx2blas.fuse_checkpoint(paths["out"], [(paths["a1"], 0.5)], again, force=True,
                             digests=False)
    with SafetensorsFile(again) as f:
        assert provenance.RECORD_KEY not in f.metadata
        assert len(json.loads(f.metadata[FUSED_KEY])) == 3  # the history is kept
    report = verify_checkpoint(again, paths["out"], [(paths["a1"], 0.5)])
    assert report.status == "verified" and report.exit_code == 0, report.summary()
    r = run_cli("verify", str(again), "--model", str(paths["out"]), "--lora",
                f"{paths['a1']}:0.5")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_base_carrying_a_record_gives_an_output_with_its_own_or_none(files, tmp_path):
    """A base that carries a record but no history (so no --force is needed): without digests
    the output has none; with them, its own, which verifies alone and with its inputs."""
    paths = files[0]
    carrying = tmp_path / "carrying.safetensors"
    with SafetensorsFile(paths["out"]) as f:
        foreign = f.metadata[provenance.RECORD_KEY]
    rewrite_metadata(paths["model"], carrying,
                     lambda m: m.update({provenance.RECORD_KEY: foreign}))
    plain, recorded = tmp_path / "plain.safetensors", tmp_path / "recorded.safetensors"
    ltx2blas.fuse_checkpoint(carrying, [(paths["a1"], 0.8)], plain, digests=False)
    ltx2blas.fuse_checkpoint(carrying, [(paths["a1"], 0.8)], recorded)
    with SafetensorsFile(plain) as f:
        assert provenance.RECORD_KEY not in f.metadata
    assert verify_checkpoint(plain, carrying, [(paths["a1"], 0.8)]).status == "verified"
    rec = record_of(recorded)
    assert rec["output"] == listed(raw_digests(recorded, "blake3"))
    assert rec != json.loads(foreign)
    assert verify_checkpoint(recorded).status == "verified"
    assert verify_checkpoint(recorded, carrying, [(paths["a1"], 0.8)]).status == "verified"


# -- bounded listings, and the blame -----------------------------------------------------------

def missing_names(n):
    return {f"gone.{i}.weight": "ab" * 32 for i in range(n)}


def test_a_record_naming_many_missing_tensors_gives_counts_and_the_first_names(files, tmp_path):
    paths = files[0]
    n = 5000
    bad = edited(paths, tmp_path, set_record(lambda rec: rec["output"].update(missing_names(n))))
    report = verify_checkpoint(bad)
    assert report.status == "differs" and report.exit_code == 1
    assert report.counts == {"missing": n}
    missing = [f for f in report.findings if f.what == "missing"]
    assert [f.tensor for f in missing] == [f"gone.{i}.weight" for i in range(NAMED)]
    text = report.summary()
    assert f"missing: {n - NAMED} more, {n} in all" in text
    assert len(text.splitlines()) < 2 * NAMED
    r = run_cli("verify", str(bad), "--json")
    assert r.returncode == 1, r.stderr
    found = json.loads(r.stdout)
    assert found["counts"] == {"missing": n} and len(found["findings"]) == NAMED
    assert len(r.stdout) < 20_000


def test_each_kind_keeps_its_first_names(files, tmp_path):
    """Many missing tensors do not crowd out a changed one: each kind keeps its own first
    names, and the verdict comes from the counts."""
    paths = files[0]

    def change(rec):
        rec["output"].update(missing_names(50))
        rec["output"][M + "norm_out.weight"] = "cd" * 32

    bad = edited(paths, tmp_path, set_record(change))
    report = verify_checkpoint(bad)
    assert report.counts == {"digest": 1, "missing": 50}
    assert ("digest", M + "norm_out.weight") in whats(report)
    assert report.status == "differs"


@pytest.mark.slow
def test_a_record_naming_a_million_missing_tensors(files, tmp_path):
    paths = files[0]
    n = 1_000_000
    bad = edited(paths, tmp_path, set_record(lambda rec: rec["output"].update(
        {f"g{i}": "a" for i in range(n)})))
    r = run_cli("verify", str(bad), "--json")
    assert r.returncode == 1, r.stderr
    found = json.loads(r.stdout)
    assert found["counts"] == {"missing": n} and len(r.stdout) < 20_000


def test_a_copied_tensor_edited_with_its_record_digest_is_named_in_the_file(files, tmp_path):
    """The file's copy of a tensor and its record digest changed together: the file alone
    cannot tell, but against the (correct) base the file's tensor is named, as not the base's,
    not the base as differing."""
    paths = files[0]
    tensor = "vae.decoder.conv.weight"
    flip_byte(paths["out"], tensor)
    digest = raw_digests(paths["out"])[tensor]
    bad = edited(paths, tmp_path, set_record(lambda rec: rec["output"].update({tensor: digest})))
    assert verify_checkpoint(bad).status == "verified"
    report = verify_checkpoint(bad, **inputs(paths))
    assert report.status == "differs" and report.exit_code == 1
    assert whats(report) == {("copied", tensor)}, report.summary()
    assert "the file's tensor is not model.safetensors's" in report.summary()
    # the file's tensor edited alone: its digest names it, and the base is not named
    flip_byte(paths["out"], M + "norm_out.weight")
    report = verify_checkpoint(paths["out"], **inputs(paths))
    assert whats(report) == {("digest", M + "norm_out.weight"), ("digest", tensor)}
    # a fused tensor edited with its record digest: the rebuild names it
    fused = M + Q + ".weight"
    flip_byte(bad, fused)
    digest = raw_digests(bad)[fused]
    both = tmp_path / "both.safetensors"
    rewrite_metadata(bad, both, set_record(lambda rec: rec["output"].update({fused: digest})))
    report = verify_checkpoint(both, **inputs(paths))
    assert whats(report) == {("rebuilt", fused), ("copied", tensor)}, report.summary()


def test_load_json_bounds():
    assert provenance.load_json('{"a": [[1]]}', "x") == {"a": [[1]]}
    value = "[" * provenance.MAX_DEPTH + "]" * provenance.MAX_DEPTH
    assert isinstance(provenance.load_json(value, "x"), list)
    for text in ("[" * (provenance.MAX_DEPTH + 1) + "]" * (provenance.MAX_DEPTH + 1), DEEP,
                 '{"a": 1, "a": 2}', "[NaN]", "[" + "1," * 4_000_001 + "1]", "{", "1" * 5000):
        with pytest.raises(provenance.MetadataJSONError):
            provenance.load_json(text, "x")
