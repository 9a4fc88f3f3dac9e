"""Hostile metadata and names, round 4: PEFT's pattern keys, numbers and JSON that crash or hang
a parser, headers that cost memory, names that drive the terminal, a second signal during the
clean-up.  Each ends in a library error naming the file, or in the right result, within a
bound stated beside the test (work counted in steps, memory in bytes, never in seconds)."""
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors
from ltx2blas.files import patterns, peft
from ltx2blas.files.safetensors import MAX_JSON_SEPARATORS, SafetensorsFile

import ckpt_helpers as ck
from test_cli_fuse import HELD
from test_hostile import header_file
from test_peft_metadata import MODULES, M, diffusers_adapter, expected, fuse, metadata

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

NAMES = [f"transformer_blocks.{b}.attn{a}.to_{q}" for b in range(12) for a in (1, 2)
         for q in "qkv"] + ["x.to_q\n", "a\nb.to_q", "proj_out", "audio_to_video_attn.to_out.0",
                            "attn1", "b", "ab", "transformer_blocks.1.ff.net.0.proj"]
#: Keys PEFT users write, and some that bend PEFT's wrapping; Python's re takes each quickly.
KEYS = ["to_q", "attn1.to_k", r"transformer_blocks\.1\d\.attn2\.to_v", ".*to_out.*", "^proj",
        "(to_q|to_k)$", "a?b", r"blocks.[0-3].attn1", "out.0", "[a-z_]+_attn", r"\d{2}\.attn1",
        "audio.*attn.*0", r"to_v$", "(to)_q", "x{0,3}to_q", "k|to_v", "a)|(b", "[^.]*",
        r"\w+\Z", "ff.net.0.proj", r"1\.ff"]


def peft_first(keys, name):
    """PEFT's get_pattern_key, run by Python's re (for keys it runs quickly)."""
    return next((k for k in keys if re.match(rf"(.*\.)?({k})$", name)), None)


@pytest.mark.parametrize("start", range(0, len(KEYS), 3))
def test_pattern_keys_mean_what_they_mean_to_peft(start):
    """The first key that matches, for every name, is the one PEFT's re.match finds: fragments
    by look-up, the rest by the automaton, in the table's order."""
    keys = KEYS[start:] + KEYS[:start]
    table = patterns.PatternTable(keys)
    for name in NAMES:
        assert table.first(name) == peft_first(keys, name), name


def test_a_backtracking_key_costs_steps_linear_in_the_name():
    """(.|.)*Z takes Python's re exponential time on 31 characters; the automaton runs a name
    in at most (length + 1) x states steps."""
    table = patterns.PatternTable(["(.|.)*Z", "to_q"])
    automaton = table.automata[0][1]
    for n in (31, 1000, 100_000):
        before = table.steps
        assert table.first("a" * n + "Z") == "(.|.)*Z"
        assert table.first("a" * n + "Y") is None
        assert table.steps - before <= 2 * (n + 2) * len(automaton.states)


def test_large_tables_cost_one_look_up_per_suffix():
    """100,000 fragment keys against many names, and 530 of them: no automaton step at all,
    whatever the table's size (the cost is the keys' parsing plus a look-up per dot)."""
    keys = [f"k{i}.to_q" for i in range(100_000)] + ["attn1.to_k"]
    table = patterns.PatternTable(keys)
    assert not table.automata
    assert [table.first(n) for n in NAMES] == [peft_first(["attn1.to_k"], n) for n in NAMES]
    keys = [rf"blocks\.{i}\.attn1" for i in range(530)]
    table = patterns.PatternTable(keys)
    assert all(table.first(n) is None for n in NAMES * 10)
    assert table.steps == 0   # each key ends in "attn1": names that do not are not run


def test_a_table_past_its_step_budget_is_refused():
    """Work beyond MAX_STEPS over all names is refused, naming the table, not run for minutes."""
    table = patterns.PatternTable([".*a.*b.*Z"] * 3)
    name = "x" * 50_000 + "Z"
    with pytest.raises(patterns.PatternError, match=f"more than {patterns.MAX_STEPS} steps"):
        for _ in range(patterns.MAX_STEPS // 50_000 + 1):
            table.first(name)


@pytest.mark.parametrize("key, says", [
    ("(?i)TO_Q", "global flags not at the start"),
    ("a{9999999999}", "OverflowError"),
    ("(" * 3000 + "a" + ")" * 3000, "more than 100 groups"),
    (r"(a)\1", "groupref"),
    ("(?=a)b", "assert"),
    ("(?i:a)b", "inline flags"),
    ("a{5000}", "more than 2000 times"),
])
def test_keys_pefts_wrapping_cannot_take_are_refused(tmp_path, rng, key, says):
    ad = diffusers_adapter(rng, {m: 8 for m in MODULES})
    with pytest.raises(errors.FormatError) as info:
        fuse(tmp_path, rng, ad, metadata(alpha_pattern={key: 4}))
    text = str(info.value)
    assert "a.safetensors" in text and "transformer.alpha_pattern" in text and says in text
    assert not (tmp_path / "out.safetensors").exists()


def test_a_hostile_pattern_fuses_as_peft_would(tmp_path, rng):
    """alpha_pattern {"(.|.)*Z": 8}: no module name ends in Z, so every module takes
    lora_alpha, and the fuse ends (where Python's re would run for hours)."""
    ad = diffusers_adapter(rng, {m: 8 for m in MODULES})
    base, out, _, _ = fuse(tmp_path, rng, ad, metadata(lora_alpha=4,
                                                       alpha_pattern={"(.|.)*Z": 8}))
    for m in MODULES:
        assert np.array_equal(out[M + m + ".weight"], expected(base, ad, m, 0.8 * 4 / 8))


@pytest.mark.parametrize("fields", [dict(r=10**400), dict(lora_alpha=10**400),
                                    dict(rank_pattern={"to_q": 10**400}),
                                    dict(alpha_pattern={"to_q": -(10**400)})])
def test_huge_numbers_are_refused_naming_the_field(tmp_path, rng, fields):
    ad = diffusers_adapter(rng, {m: 8 for m in MODULES})
    with pytest.raises(errors.FormatError, match=r"PEFT takes a positive .* \(ltx2blas: up to"):
        fuse(tmp_path, rng, ad, metadata(**fields))


def test_other_components_fields_are_left_unread(tmp_path, rng):
    """text_encoder.* fields configure a component LTX-2's pipeline does not load adapters
    into: diffusers leaves them unread when it loads the transformer, and so does ltx2blas,
    saying so, instead of a phantom configuration at PEFT's defaults."""
    ad = diffusers_adapter(rng, {m: 8 for m in MODULES})
    meta = metadata(r=8, lora_alpha=4)
    config = json.loads(meta["lora_adapter_metadata"])
    config.update({"text_encoder.r": 64, "text_encoder.lora_alpha": 1})
    meta["lora_adapter_metadata"] = json.dumps(config)
    base, out, report, _ = fuse(tmp_path, rng, ad, meta)
    for m in MODULES:
        assert np.array_equal(out[M + m + ".weight"], expected(base, ad, m, 0.8 * 4 / 8))
    assert ("its lora_adapter_metadata's text_encoder fields not read (diffusers reads them "
            "for that component alone)") in report.summary()
    configs, ignored = peft.read_configs({"lora_adapter_metadata": json.dumps(
        {"r": 4, "transformer.r": 8, "text_encoder.r": 2})}, "x")
    assert sorted(configs) == ["", "transformer"] and ignored == ["text_encoder"]
    with pytest.raises(errors.FormatError, match=r"configures several \(\(unprefixed fields\), "
                                                 r"transformer\)"):
        peft.config_of(configs, "blocks.0.to_q.lora_A.weight", "x")


def test_rslora_summary_says_sqrt_rank(tmp_path, rng):
    ad = diffusers_adapter(rng, {m: 8 for m in MODULES})
    _, _, report, _ = fuse(tmp_path, rng, ad, metadata(lora_alpha=4, use_rslora=True))
    assert "4 scaled by alpha / sqrt(rank) (rsLoRA) from its lora_adapter_metadata" in \
        report.summary()


# ---- ComfyUI's markers -----------------------------------------------------------------------

def comfy_model(tmp_path, rng, marker):
    model = ck.model(rng, fp8="F8_E4M3")
    model[M + "transformer_blocks.0.attn1.to_q.weight_scale"] = ("F32", np.ones((), np.float32))
    model[M + "transformer_blocks.0.attn1.to_q.comfy_quant"] = (
        "U8", np.frombuffer(marker if isinstance(marker, bytes) else json.dumps(marker).encode(),
                            np.uint8).copy())
    ad = ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4)
    return (ck.write(tmp_path / "m.safetensors", model),
            ck.write(tmp_path / "a.safetensors", ad))


@pytest.mark.parametrize("marker, says", [
    ({"formats": "float8_e4m3fn"}, 'has no "format" key'),
    ({"format": ["float8_e4m3fn"]}, "\"format\" is a JSON list, not a format's name"),
    ({"format": {"x": 1}}, "\"format\" is a JSON dict, not a format's name"),
    (["float8_e4m3fn"], "is a JSON list, not an object"),
    (b"[" * 100_000 + b"]" * 100_000, "nests JSON too deeply"),
])
def test_bad_comfy_markers_are_library_errors(tmp_path, rng, marker, says):
    model, lora = comfy_model(tmp_path, rng, marker)
    with pytest.raises(errors.Ltx2BlasError, match=re.escape(says)):
        ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_deep_quantization_metadata_is_a_library_error(tmp_path, rng):
    model = ck.model(rng, fp8="F8_E4M3")
    deep = "[" * 100_000 + "]" * 100_000
    path = ck.write(tmp_path / "m.safetensors", model, {"_quantization_metadata": deep})
    lora = ck.write(tmp_path / "a.safetensors",
                    ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4))
    with pytest.raises(errors.FormatError, match="_quantization_metadata .*nests JSON too deeply"):
        ltx2blas.fuse_checkpoint(path, [(lora, 1.0)], tmp_path / "o.safetensors")


# ---- memory: a header's cost is bounded by its separators ------------------------------------

MEASURE = """
import resource, sys
from ltx2blas import errors
from ltx2blas.files.safetensors import SafetensorsFile
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    SafetensorsFile(sys.argv[1])
    print("opened")
except errors.FormatError as exc:
    print("refused:", str(exc)[-160:])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def measured(path):
    r = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True,
                       text=True, timeout=600, cwd="/")
    assert r.returncode == 0, r.stderr
    said, grew = r.stdout.strip().splitlines()
    return said, int(grew)


@pytest.mark.parametrize("kind", ["metadata entries", "zero-size tensors", "empty lists"])
def test_headers_past_the_separator_limit_are_refused_in_bounded_memory(tmp_path, kind):
    """Past MAX_JSON_SEPARATORS a header is refused before it is parsed: the memory it costs
    is its bytes read and decoded, at most 3 x its size (here about 25-40 MB each), not the
    20-40 x that Python's objects for its values would take."""
    n = MAX_JSON_SEPARATORS // 2 + 10
    if kind == "metadata entries":
        text = '{"__metadata__":{' + ",".join(f'"{i:x}":""' for i in range(n)) + "}}"
    elif kind == "zero-size tensors":
        text = "{" + ",".join(f'"t{i:x}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
                              for i in range(n // 5)) + "}"
    else:   # what a 99 MB lora_adapter_metadata of empty lists is made of, in a string
        text = '{"__metadata__":{"lora_adapter_metadata":"' + "[]," * (2 * n) + '"}}'
    path = header_file(tmp_path / "h.safetensors", text)
    said, grew = measured(path)
    assert said.startswith("refused:") and "JSON separators" in said
    assert grew <= 3 * path.stat().st_size + 16 * 2**20


def test_a_header_at_the_separator_limit_parses_within_its_bound(tmp_path):
    """Just under the limit the header is parsed, within the stated bound: 3 x its size and
    70 bytes per separator (measured: about 52, the strict parser's pairs and dict)."""
    n = MAX_JSON_SEPARATORS // 2 - 10
    text = '{"__metadata__":{' + ",".join(f'"{i:x}":""' for i in range(n)) + "}}"
    path = header_file(tmp_path / "h.safetensors", text)
    said, grew = measured(path)
    assert said == "opened"
    assert grew <= 3 * path.stat().st_size + 70 * MAX_JSON_SEPARATORS


# ---- an adapter's own tensors, and names that drive a terminal ------------------------------

def test_many_own_tensors_are_summarised_and_recorded_boundedly(tmp_path, rng):
    """20,000 tensors of modules the model lacks: the summary names three modules (found in
    linear time) and the output's record names 20 of them and counts them all."""
    model = ck.write(tmp_path / "m.safetensors", ck.model(rng))
    ad = ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4)
    for i in range(20_000):
        ad[f"diffusion_model.slot_{i}.net.0.weight"] = ("BF16", np.zeros(1, np.uint16))
    lora = ck.write(tmp_path / "a.safetensors", ad)
    report = ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    assert ("20000 tensors of modules the model does not have were not fused (slot_0.net.0, "
            "slot_1.net.0, slot_2.net.0, ...)") in report.summary()
    with SafetensorsFile(tmp_path / "o.safetensors") as f:
        (record,) = json.loads(f.metadata["ltx2blas.fused"])
    assert len(record["not_fused"]) == 20 and record["not_fused_count"] == 20_000


def test_control_characters_in_names_never_reach_the_terminal(tmp_path, rng):
    """An escape sequence and a newline in an adapter's tensor names: the summary and the
    error line show them escaped, so they neither clear the screen nor forge a line."""
    model = ck.write(tmp_path / "m.safetensors", ck.model(rng))
    ad = ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4)
    evil = "x\x1b[2J\nfused 999 modules -> /etc/passwd"
    ad[f"diffusion_model.transformer_blocks.0.attn1.to_q.{evil}"] = ("BF16",
                                                                  np.zeros(1, np.uint16))
    lora = ck.write(tmp_path / "a.safetensors", ad)
    run = [sys.executable, "-m", "ltx2blas", "fuse", str(model), "--lora", str(lora), "-o",
           str(tmp_path / "o.safetensors"), "-q"]
    r = subprocess.run(run + ["--allow-unmatched"], capture_output=True, text=True, cwd="/",
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\\x1b[2J\\nfused 999 modules" in r.stdout
    assert not any(line.startswith("fused 999") for line in r.stdout.splitlines())
    r = subprocess.run(run, capture_output=True, text=True, cwd="/", timeout=300)
    assert r.returncode == 2 and "\x1b" not in r.stderr and r.stderr.count("\n") == 1


# ---- a second signal during the clean-up ------------------------------------------------------

def fuse_held_at_its_first_progress(tmp_path, rng, script, *script_args):
    """A fuse started under ``script`` (HELD or LATE), once it holds at its first progress
    report; returns (the process, the output path)."""
    model = ck.write(tmp_path / "m.safetensors", ck.model(rng))
    lora = ck.write(tmp_path / "a.safetensors",
                    ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4))
    out, ready = tmp_path / "out.safetensors", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", script, str(ready), *script_args, "fuse",
                             str(model), "--lora", str(lora), "-o", str(out)], cwd="/",
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300  # a guard against a hang only: the wait ends on a file
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    return proc, out


@pytest.mark.parametrize("first, second", [("SIGINT", "SIGTERM"), ("SIGTERM", "SIGINT"),
                                           ("SIGHUP", "SIGTERM")])
def test_a_second_signal_does_not_interrupt_the_clean_up(tmp_path, rng, first, second):
    """Two signals a moment apart: the one Python handles first stops the command (signals
    pending together are handled in number order), the other is ignored; one line, the
    first's exit code, the temporary output removed."""
    proc, out = fuse_held_at_its_first_progress(tmp_path, rng, HELD)
    proc.send_signal(getattr(signal, first))
    proc.send_signal(getattr(signal, second))
    stdout, stderr = proc.communicate(timeout=120)
    lines = {130: "ltx2blas: interrupted", 143: "ltx2blas: terminated by SIGTERM",
             129: "ltx2blas: terminated by SIGHUP"}
    codes = {130 if s == "SIGINT" else 128 + getattr(signal, s) for s in (first, second)}
    assert proc.returncode in codes, stderr
    assert stderr.strip().splitlines() == [lines[proc.returncode]], stderr
    assert not out.exists() and not any(".ltx2blas-tmp-" in p.name for p in tmp_path.iterdir())


# The command stopped by its first signal, the second one arrives after main() has returned,
# sent to the main thread itself so that Python runs its handler at the next instruction.
LATE = HELD.replace("sys.exit(cli.main(sys.argv[2:]))", """\
import signal, threading
code = cli.main(sys.argv[3:])
signal.pthread_kill(threading.get_ident(), getattr(signal, sys.argv[2]))
time.sleep(0)
sys.exit(code)""")


@pytest.mark.parametrize("first, second", [("SIGTERM", "SIGINT"), ("SIGINT", "SIGTERM")])
def test_a_second_signal_after_the_stop_does_not_change_the_exit(tmp_path, rng, first, second):
    """A second signal that reaches the process only after the command has cleaned up and
    returned (a loaded machine delays it) is ignored too: the first's exit code and line,
    not a death by the second signal."""
    assert LATE != HELD
    proc, out = fuse_held_at_its_first_progress(tmp_path, rng, LATE, second)
    proc.send_signal(getattr(signal, first))
    stdout, stderr = proc.communicate(timeout=120)
    code, line = {"SIGINT": (130, "ltx2blas: interrupted"),
                  "SIGTERM": (143, "ltx2blas: terminated by SIGTERM")}[first]
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines() == [line], stderr
    assert not out.exists()
