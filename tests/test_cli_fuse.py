"""``ltx2blas fuse``: the whole job as one command, with progress, a summary, one-line errors
and an exit code per kind of error."""
import subprocess
import sys

import numpy as np
import pytest

import ckpt_helpers as ck

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")


def run(*args, cwd="/"):
    return subprocess.run([sys.executable, "-m", "ltx2blas", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def paths(tmp_path, rng):
    model = ck.write(tmp_path / "model.safetensors", ck.model(rng))
    lora = ck.write(tmp_path / "lora.safetensors",
                    ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4))
    return model, lora, tmp_path / "out.safetensors"


def test_fuse_writes_and_summarises(paths):
    model, lora, out = paths
    r = run("fuse", model, "--lora", f"{lora}:0.75", "-o", out, "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert out.exists()
    assert "fused 1 module " in r.stdout and "peak memory" in r.stdout
    # a small weight among other tensors: copying is most of the work, its rate in GB/s
    assert "GB/s read and written" in r.stdout and "GFLOP/s" not in r.stdout
    assert "x 0.75" in r.stdout
    # not a terminal: plain log lines, ending at 100 %
    assert r.stderr.strip().splitlines()[-1].startswith("ltx2blas: 100%")


def test_dry_run(paths):
    model, lora, out = paths
    r = run("fuse", model, "--lora", lora, "-o", out, "--dry-run", "-v")
    assert r.returncode == 0 and "would fuse 1 module " in r.stdout
    assert "transformer_blocks.0.attn1.to_q.weight" in r.stdout
    assert not out.exists()


@pytest.mark.parametrize("case, code, text", [
    ("missing", 4, "cannot open"),
    ("malformed", 3, "too short"),
    ("nomatch", 2, "matches no weight"),
    ("same", 2, "is an input"),  # an argument that does not fit (README: exit 2)
])
def test_errors_are_one_line_with_an_exit_code_per_kind(paths, tmp_path, case, code, text):
    model, lora, out = paths
    if case == "missing":
        args = ("fuse", tmp_path / "absent.safetensors", "--lora", lora, "-o", out)
    elif case == "malformed":
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"\0\0")
        args = ("fuse", bad, "--lora", lora, "-o", out)
    elif case == "nomatch":
        args = ("fuse", lora, "--lora", lora, "-o", out)  # an adapter has no *.weight to fuse
    else:
        args = ("fuse", model, "--lora", lora, "-o", model)
    r = run(*args)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.startswith("ltx2blas: error:") and text in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_lora_argument_parsing():
    from ltx2blas.cli import _lora_arg

    assert _lora_arg("a.safetensors") == ("a.safetensors", 1.0)
    assert _lora_arg("a.safetensors:0.5") == ("a.safetensors", 0.5)
    assert _lora_arg("dir:with:colons/a.safetensors") == ("dir:with:colons/a.safetensors", 1.0)
    assert _lora_arg("c:/x.safetensors:-1") == ("c:/x.safetensors", -1.0)


def test_rule_option(paths, tmp_path, rng):
    """--rule picks the several-adapter rule (default addmm); the output records it, and the two
    rules' outputs are the tensor-level fuse by that rule."""
    import json

    import numpy as np

    import ltx2blas
    from ltx2blas.files.safetensors import SafetensorsFile

    model, lora, _ = paths
    second = ck.write(tmp_path / "second.safetensors",
                      ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=300))
    got = {}
    for rule in ("addmm", "sum", None):
        out = tmp_path / f"out-{rule}.safetensors"
        extra = () if rule is None else ("--rule", rule)
        r = run("fuse", model, "--lora", f"{lora}:0.8", "--lora", f"{second}:1.5", "-o", out, *extra)
        assert r.returncode == 0, r.stderr
        assert f"{rule or 'addmm'} rule" in r.stdout
        with SafetensorsFile(out) as f:
            assert f.metadata["ltx2blas.rule"].startswith((rule or "addmm") + ":")
            assert json.loads(f.metadata["ltx2blas.layouts"]) == {"bf16": 1}
            got[rule] = f.read("model.diffusion_model.transformer_blocks.0.attn1.to_q.weight")
    assert np.array_equal(got[None], got["addmm"]) and not np.array_equal(got["addmm"], got["sum"])
    with SafetensorsFile(model) as m, SafetensorsFile(lora) as a, SafetensorsFile(second) as b:
        w = m.read("model.diffusion_model.transformer_blocks.0.attn1.to_q.weight")
        key = "diffusion_model.transformer_blocks.0.attn1.to_q.lora_"
        ads = [(a.read(key + "A.weight"), a.read(key + "B.weight"), 0.8),
               (b.read(key + "A.weight"), b.read(key + "B.weight"), 1.5)]
    for rule in ("addmm", "sum"):
        assert np.array_equal(got[rule], ltx2blas.fuse_loras(w, ads, rule=rule))
    r = run("fuse", model, "--lora", lora, "-o", tmp_path / "x.safetensors", "--rule", "stack")
    assert r.returncode == 2 and "invalid choice" in r.stderr


# ---- messages and exit codes a user meets in the first hour ----

def test_summary_says_what_happened(paths, tmp_path, rng):
    """One adapter is not reported as combined by a rule; a dry run would copy, not copied;
    -v lists the fused weights in a real run too."""
    model, lora, out = paths
    r = run("fuse", model, "--lora", lora, "-o", out, "-q", "-v")
    assert r.returncode == 0, r.stderr
    assert "rule" not in r.stdout.splitlines()[0] and "copied 9 other tensors" in r.stdout
    assert "transformer_blocks.0.attn1.to_q.weight  <- adapters [0] (LoRA)" in r.stdout
    r = run("fuse", model, "--lora", lora, "--dry-run")
    assert r.returncode == 0 and "would copy 9 other tensors" in r.stdout and "copied" not in r.stdout


@pytest.mark.parametrize("args, code, text", [
    (("--lora", "{lora}=0.8", "-o", "{out}"), 2, "a strength follows a colon (--lora {lora}:0.8)"),
    (("--lora", "{lora}:inf", "-o", "{out}"), 2, "the strength 'inf' is not finite as f32"),
    (("--lora", "{lora}:1e40", "-o", "{out}"), 2, "the strength '1e40' is not finite as f32"),
    (("--lora", "{lora}", "-o", ""), 2, "-o/--output is empty"),
    (("--lora", "{lora}", "-o", "/dev/stdout"), 4, "output /dev/stdout is a FIFO (a pipe)"),
    (("--lora", "{lora}", "-o", "{out}", "--seed", "3"), 2,
     "--seed seeds --fp8-rounding stochastic"),
    (("--lora", "{lora}", "-o", "{out}", "--threads", str(2**64)), 2, "at most 65536 threads"),
    (("--lora", "{lora}", "-o", "{out}", "--fp8-overflow", "nan", "--fp8-rounding", "stochastic"),
     2, "--fp8-overflow nan is torch's nearest cast up to 2.12; --fp8-rounding stochastic never "
        "rounds past the largest finite value, so it takes --fp8-overflow saturate"),
    (("-o", "{out}"), 2, "the following arguments are required: --lora (see ltx2blas fuse --help)"),
])
def test_mistakes_are_one_line_with_their_code(paths, args, code, text):
    model, lora, out = paths
    args = [a.format(lora=lora, out=out) for a in args]
    r = subprocess.run([sys.executable, "-m", "ltx2blas", "fuse", str(model), *args],
                       capture_output=True, text=True, cwd="/", timeout=300)  # stdout a pipe
    assert r.returncode == code, r.stderr
    assert text.format(lora=lora) in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and "usage:" not in r.stderr
    assert not out.exists()


def test_library_words_become_the_command_s(paths, tmp_path):
    """The library says force=True; the command says --force."""
    model, lora, out = paths
    assert run("fuse", model, "--lora", lora, "-o", out, "-q").returncode == 0
    r = run("fuse", out, "--lora", lora, "-o", tmp_path / "again.safetensors")
    assert r.returncode == 2 and "pass --force to fuse again" in r.stderr
    assert "force=True" not in r.stderr


def test_top_level_help_is_plain_text():
    r = run("--help")
    assert r.returncode == 0 and "``" not in r.stdout and "Exit codes:" in r.stdout


# The command, its progress callback held at the first fused tensor until a signal comes: the
# temporary output is open and partly written, and the fuse cannot end before the signal
# arrives, however fast or loaded the machine.
HELD = """
import sys, time
from ltx2blas import cli

class Held(cli._ProgressPrinter):
    def __call__(self, progress):
        open(sys.argv[1], "w").close()
        while True:
            time.sleep(1)

cli._ProgressPrinter = Held
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_termination_removes_the_temporary_output(tmp_path, rng, name, code):
    """timeout, systemd and docker stop send SIGTERM, a closed terminal SIGHUP: the fuse stops
    as Ctrl-C stops it, the temporary file removed, one line, exit 128 + the signal."""
    import signal
    import time

    modules = {f"transformer_blocks.{i}.attn1.to_q": (256, 256) for i in range(8)}
    base = {"model.diffusion_model." + m + ".weight": ("BF16", np.zeros(s, np.uint16))
            for m, s in modules.items()}
    ad = {}
    for m, (o, i) in modules.items():
        ad["diffusion_model." + m + ".lora_A.weight"] = ("BF16", np.full((16, i), 0x3C00, "u2"))
        ad["diffusion_model." + m + ".lora_B.weight"] = ("BF16", np.full((o, 16), 0x3C00, "u2"))
    model = ck.write(tmp_path / "big.safetensors", base)
    lora = ck.write(tmp_path / "big-lora.safetensors", ad)
    out, ready = tmp_path / "out.safetensors", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", HELD, str(ready), "fuse", str(model), "--lora",
                             str(lora), "-o", str(out), "--threads", "1"], cwd="/", text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300  # a guard against a hang only: the wait ends on a file
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    assert any(".ltx2blas-tmp-" in p.name for p in tmp_path.iterdir())
    proc.send_signal(getattr(signal, name))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines()[-1] == f"ltx2blas: terminated by {name}"
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big-lora.safetensors",
                                                          "big.safetensors", "ready"]


def test_fp8_overflow_is_recorded_and_summarised(tmp_path, rng):
    """--fp8-overflow nan: past 448 is NaN, the metadata says so, the summary counts them."""
    model = ck.model(rng, fp8="F8_E4M3")
    mp = ck.write(tmp_path / "fp8.safetensors", model)
    lora = ck.write(tmp_path / "lora.safetensors",
                    ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4))
    out = tmp_path / "out.safetensors"
    r = run("fuse", mp, "--lora", f"{lora}:60000", "-o", out, "-q", "--fp8-overflow", "nan")
    assert r.returncode == 0, r.stderr
    assert "rounded past their format's largest finite value" in r.stdout
    assert "stores them as NaN (--fp8-overflow nan)" in r.stdout
    from ltx2blas.files.safetensors import SafetensorsFile

    with SafetensorsFile(out) as f:
        assert f.metadata["ltx2blas.fp8_overflow"].startswith("nan: ")


def test_unknown_options_are_named_by_their_command(paths):
    model, lora, out = paths
    r = run("--frobnicate")
    assert r.returncode == 2 and r.stderr == ("ltx2blas: error: unrecognized option --frobnicate "
                                              "(see ltx2blas --help)\n")
    r = run("fuse", model, "--lora", lora, "-o", out, "--bogus")
    assert r.returncode == 2 and r.stderr == ("ltx2blas fuse: error: unrecognized arguments: "
                                              "--bogus (see ltx2blas fuse --help)\n")
    assert not out.exists()
    r = run("demo", "--help")
    assert r.returncode == 0 and "Fuse an LTX-2-shaped adapter into a weight in memory" in r.stdout


def test_an_adapter_that_matches_nothing_says_why_allow_unmatched_cannot_help(tmp_path, rng):
    model = ck.write(tmp_path / "m.safetensors", ck.model(rng))
    lora = ck.write(tmp_path / "a.safetensors", {
        "diffusion_model.nothing_here.lora_A.weight": ("BF16", np.zeros((4, 48), np.uint16)),
        "diffusion_model.nothing_here.lora_B.weight": ("BF16", np.zeros((64, 4), np.uint16))})
    r = run("fuse", model, "--lora", lora, "-o", tmp_path / "o.safetensors", "--allow-unmatched")
    assert r.returncode == 2
    assert ("--allow-unmatched cannot help, as it fuses the modules that match and none does"
            in r.stderr)


def test_the_summary_of_a_small_fuse_counts_in_words_and_digits(paths):
    """One module, one tensor, and GFLOP of a small file as digits rather than 0/0."""
    model, lora, out = paths
    r = run("fuse", model, "--lora", lora, "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("fused 1 module (1 bf16), copied 9 other tensors")
    assert "2.5e-05 GFLOP" in r.stdout and "0/0 GFLOP" not in r.stderr
    assert "0.00/0.00" not in r.stderr and "/2.5e-05 GFLOP" in r.stderr


def test_output_that_is_standard_output_is_refused(paths, tmp_path):
    """-o /dev/stdout with stdout sent to a file would write the checkpoint where its summary
    goes: refused, nothing written."""
    model, lora, _ = paths
    target = tmp_path / "captured"
    with open(target, "w") as stdout:
        r = subprocess.run([sys.executable, "-m", "ltx2blas", "fuse", str(model), "--lora",
                            str(lora), "-o", "/dev/stdout"], stdout=stdout,
                           stderr=subprocess.PIPE, text=True, cwd="/", timeout=300)
    assert r.returncode == 2 and "is this command's standard output" in r.stderr
    assert target.stat().st_size == 0


def test_demo_prints_no_markup():
    r = run("demo", "--rows", "128", "--cols", "128", "--rank", "4")
    assert r.returncode == 0, r.stderr
    assert "`" not in r.stdout
