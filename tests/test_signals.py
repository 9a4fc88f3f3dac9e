"""SIGINT, SIGTERM and SIGHUP at any moment, and closed pipes (README, "Errors and exit codes").

Each command runs in a child process whose test hook puts the signal at a chosen point: inside
the wait for a worker pool whose workers never end (as a worker waiting on a lock that the
interrupted main thread left held never ends), just before and just after the rename that
commits the output, after the command has returned, and inside a clean-up that never ends.  The
hooks decide where the signal lands, not the machine's speed; the timeouts only guard against
a hang.  A sweep over many moments on a file of many tensors is marked slow.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ltx2blas
from ltx2blas.files.safetensors import SafetensorsFile

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

#: A guard against a hang only: every run below ends in well under a second once signalled.
HANG = 60
CODES = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}
LINES = {"SIGINT": "ltx2blas: interrupted", "SIGTERM": "ltx2blas: terminated by SIGTERM",
         "SIGHUP": "ltx2blas: terminated by SIGHUP"}

# The child: the command line itself (cli.main() reading sys.argv), with a hook run first.
# A shell starting a job in the background hands it SIGINT ignored, and Python keeps that.
CHILD = r"""
import os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)
SIG = getattr(signal, os.environ["SIG"])

def send():
    os.kill(os.getpid(), SIG)
    time.sleep(0)  # the handler runs in the main thread at its next instruction

never = threading.Event()  # what a worker that never ends waits for
{hook}
from ltx2blas import cli
sys.argv = ["ltx2blas"] + sys.argv[1:]
sys.exit(cli.main())
"""


def child(hook, sig, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    env = dict(os.environ, SIG=sig)
    try:
        return subprocess.run([sys.executable, "-c", CHILD.replace("{hook}", hook),
                               *map(str, args)], stdout=stdout, stderr=stderr, text=True,
                              cwd="/", env=env, timeout=HANG)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the command did not end within {HANG} s of {sig}: it hangs")


def temps(folder):
    return [p.name for p in folder.iterdir() if ".ltx2blas-tmp-" in p.name]


def stopped(r, sig):
    """Ended by ``sig`` as the rule says: its exit code and one line, no traceback."""
    assert r.returncode == CODES[sig], r.stderr
    assert r.stderr.strip().splitlines() == [LINES[sig]], r.stderr


@pytest.fixture
def files(tmp_path, rng):
    """A model, an adapter, a file fused from them (with its record), a previous output."""
    model = ck.write(tmp_path / "m.safetensors", ck.model(rng))
    lora = ck.write(tmp_path / "a.safetensors", ck.adapter(rng, list(ck.MODULES), rank=4))
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], fused)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"the previous output")
    return model, lora, fused, out


def tuned(tmp_path, rng, model):
    """A checkpoint tuned from ``model``: every weight changed by a rank-2 product."""
    tensors = {}
    with SafetensorsFile(model) as f:
        for name, info in f.tensors.items():
            value = np.array(f.read(name))
            if name.endswith(".weight") and info.dtype == "BF16" and len(info.shape) == 2:
                f32 = (value.astype(np.uint32) << 16).view(np.float32)
                a = rng.standard_normal((info.shape[0], 2)).astype(np.float32) * 0.01
                b = rng.standard_normal((2, info.shape[1])).astype(np.float32)
                value = (((f32 + a @ b).view(np.uint32) + 0x8000) >> 16).astype(np.uint16)
            tensors[name] = (info.dtype, value)
    return ck.write(tmp_path / "tuned.safetensors", tensors)


def command(which, files, tmp_path, rng):
    model, lora, _, out = files
    if which == "fuse":
        return ["fuse", model, "--lora", lora, "-o", out, "-q"]
    if which == "quantize":
        return ["quantize", model, "-o", out, "--format", "comfy_nvfp4", "-q"]
    if which == "resize":
        return ["resize", lora, "-o", out, "--rank", "2", "-q"]
    if which == "merge":
        return ["merge", lora, f"{lora}:0.5", "-o", out, "--rank", "2", "-q"]
    return ["extract", tuned(tmp_path, rng, model), "--base", model, "-o", out, "--rank", "2",
            "-q"]


# ---- a signal inside a worker pool's wait -----------------------------------------------------

# Every tensor's hash waits for ever; the main thread is signalled as it starts waiting for a
# worker's result.
POOL_WAIT = """
import concurrent.futures
from ltx2blas.files import provenance
provenance.tensor_digest = lambda *a, **k: never.wait()
real_result = concurrent.futures.Future.result
def result(self, timeout=None):
    if threading.current_thread() is threading.main_thread():
        send()
    return real_result(self, timeout)
concurrent.futures.Future.result = result
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_in_verifys_wait_for_its_hashing_workers_ends_it(files, sig):
    """verify hashes a file's tensors on a pool: a signal while it waits for a worker that
    never ends stops it (the workers are not joined), 128 + n and one line."""
    r = child(POOL_WAIT, sig, "verify", files[2], "-q")
    stopped(r, sig)


# The rebuild's background hashing never ends; the signal comes as verify waits for it.
HASHER_WAIT = """
from ltx2blas.files import provenance
provenance.tensor_digest = lambda *a, **k: never.wait()
real_wait = provenance.Hasher.wait
def wait(self):
    send()
    return real_wait(self)
provenance.Hasher.wait = wait
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_in_verifys_wait_for_its_digest_threads_ends_it(sig):
    """verify --model --lora of a format 1 file (whose record holds the digests of the base's
    tensors fused) hashes the base as it rebuilds, on background threads: a signal while it
    waits for them stops it, however long they would take."""
    data = os.path.join(os.path.dirname(__file__), "data", "format1")
    r = child(HASHER_WAIT, sig, "verify", os.path.join(data, "fused.safetensors"), "--model",
              os.path.join(data, "base.safetensors"), "--lora",
              os.path.join(data, "a1.safetensors") + ":0.8", "--lora",
              os.path.join(data, "a2.safetensors") + ":-1.5", "-q")
    stopped(r, sig)


# ---- both sides of the rename -----------------------------------------------------------------

BEFORE_RENAME = """
real_fsync, sent = os.fsync, []
def fsync(fd):
    if not sent:  # the temporary file's, the last step before the rename
        sent.append(1)
        send()
    return real_fsync(fd)
os.fsync = fsync
"""

# during: the signal reaches the process as the rename runs; after: once it has returned
AT_RENAME = """
real_replace = os.replace
def replace(src, dst, *args, **kwargs):
    if ".ltx2blas-tmp-" not in os.fspath(src):
        return real_replace(src, dst, *args, **kwargs)
    if WHEN == "during":
        send()
    real_replace(src, dst, *args, **kwargs)
    if WHEN == "after":
        send()
os.replace = replace
"""


@pytest.mark.parametrize("which", ["fuse", "extract", "quantize", "resize", "merge"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_before_the_rename_leaves_the_destination_as_it_was(files, tmp_path, rng,
                                                                     which, sig):
    r = child(BEFORE_RENAME, sig, *command(which, files, tmp_path, rng))
    stopped(r, sig)
    assert files[3].read_bytes() == b"the previous output"
    assert temps(tmp_path) == [] and r.stdout == ""


def complete(path):
    with SafetensorsFile(path) as f:
        return len(f.tensors)


@pytest.mark.parametrize("which", ["fuse", "extract", "quantize", "resize", "merge"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("when", ["during", "after"])
def test_a_signal_at_the_rename_finds_the_output_complete_and_says_so(files, tmp_path, rng,
                                                                      which, sig, when):
    """The rename is the commit point: a signal that reaches the process as it runs or after
    it is not an interruption; the command prints its summary, says the output is complete
    and exits 0."""
    out = files[3]
    r = child(f"WHEN = {when!r}\n" + AT_RENAME, sig, *command(which, files, tmp_path, rng))
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"ltx2blas: {sig} came after the output was complete: {out} is written in full and in "
        "place"], r.stderr
    assert r.stdout.startswith({"fuse": "fused ", "extract": "extracted ",
                                "quantize": "quantized ", "resize": "resized ",
                                "merge": "merged "}[which]), r.stdout
    assert complete(out) > 0 and temps(tmp_path) == []


AFTER_RETURN = """
from ltx2blas import cli
real_main = cli.main
def main():
    code = real_main()
    send()  # the command has returned; the process is on its way out
    return code
cli.main = main
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_after_the_command_returned_does_not_change_its_exit(files, sig):
    """Neither a death by the signal nor a traceback once the output is written and the
    summary printed: exit 0."""
    model, lora, _, out = files
    r = child(AFTER_RETURN, sig, "fuse", model, "--lora", lora, "-o", out, "-q")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("fused ") and complete(out) > 0


# The signal's exception raised inside a __del__, where Python prints it and goes on.
IN_DEL = """
real_fsync, sent = os.fsync, []
class Sends:
    def __del__(self):
        send()
        for _ in range(100):
            pass
def fsync(fd):
    if not sent:
        sent.append(1)
        Sends()
    return real_fsync(fd)
os.fsync = fsync
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_whose_exception_python_swallows_still_stops_the_command(files, tmp_path,
                                                                           sig):
    """Not "Exception ignored ..." and a finished fuse: the signal is recorded, and the commit
    that follows refuses to rename."""
    model, lora, _, out = files
    r = child(IN_DEL, sig, "fuse", model, "--lora", lora, "-o", out, "-q")
    stopped(r, sig)
    assert out.read_bytes() == b"the previous output" and temps(tmp_path) == []


# A clean-up that never ends: every exception swallowed from the signal on.
STUCK_CLEAN_UP = """
def fsync(fd):
    try:
        send()
    except BaseException:
        pass
    while True:
        try:
            time.sleep(0.05)
        except BaseException:
            pass
os.fsync = fsync
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_clean_up_that_never_ends_is_ended_for_it(files, tmp_path, sig):
    """The last resort: the process ends soon after the signal all the same, the temporary
    file removed, the destination unchanged, the command's line and exit code."""
    model, lora, _, out = files
    r = child(STUCK_CLEAN_UP, sig, "fuse", model, "--lora", lora, "-o", out, "-q")
    stopped(r, sig)
    assert out.read_bytes() == b"the previous output" and temps(tmp_path) == []


# ---- closed pipes -----------------------------------------------------------------------------

def closed_pipe():
    """The write end of a pipe whose reader has gone (| head after its lines)."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_a_closed_stdout_ends_the_output_quietly(files):
    model, lora, fused, _ = files
    w = closed_pipe()
    try:
        dry = subprocess.run([sys.executable, "-m", "ltx2blas", "fuse", str(model), "--lora",
                              str(lora), "--dry-run", "-v"], stdout=w, stderr=subprocess.PIPE,
                             text=True, cwd="/", timeout=HANG)
        checked = subprocess.run([sys.executable, "-m", "ltx2blas", "verify", str(fused),
                                  "--json"], stdout=w, stderr=subprocess.PIPE, text=True,
                                 cwd="/", timeout=HANG)
    finally:
        os.close(w)
    assert (dry.returncode, dry.stderr) == (0, "")
    assert (checked.returncode, checked.stderr) == (0, "")  # verified: its own code


def test_a_closed_stderr_stops_the_progress_not_the_fuse(files, tmp_path):
    model, lora, _, out = files
    w = closed_pipe()
    try:
        r = subprocess.run([sys.executable, "-m", "ltx2blas", "fuse", str(model), "--lora",
                            str(lora), "-o", str(out)], stdout=subprocess.PIPE, stderr=w,
                           text=True, cwd="/", timeout=HANG)
    finally:
        os.close(w)
    assert r.returncode == 0 and r.stdout.startswith("fused ")
    assert complete(out) > 0 and temps(tmp_path) == []


# ---- a sweep over many moments ----------------------------------------------------------------

def many_tensors(tmp_path, rng, count):
    """A model of ``count`` small tensors (a few fused weights among them) and its adapter."""
    tensors = {f"model.diffusion_model.{m}.weight": ("BF16", random_bf16(rng, s, 0.02))
               for m, s in ck.MODULES.items()}
    for i in range(count - len(tensors)):
        tensors[f"extra.{i}.weight"] = ("F32", np.full(4, i, np.float32))
    model = ck.write(tmp_path / "many.safetensors", tensors)
    lora = ck.write(tmp_path / "many-lora.safetensors", ck.adapter(rng, list(ck.MODULES), 4))
    return model, lora


def sweep(args, sig, check, tries=25, reset=lambda: None):
    """Run ``args`` once unsignalled to time it, then ``tries`` times, each signalled at
    another moment spread over that time from the moment the command has started (its
    handlers set: before that, while Python starts and imports it, a signal has its default
    action); returns (tries, clean, hangs, what the others did)."""
    argv = [sys.executable, "-m", "ltx2blas", *map(str, args)]
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import ltx2blas.cli"], cwd="/", timeout=600)
    start = time.monotonic() - t0 + 0.1
    t0 = time.monotonic()
    subprocess.run(argv, capture_output=True, cwd="/", timeout=600)
    span = time.monotonic() - t0 - start
    reset()
    clean, hangs, others = 0, 0, []
    for i in range(tries):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd="/")
        time.sleep(start + span * i / tries)
        proc.send_signal(getattr(signal, sig))
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            hangs += 1
            proc.kill()
            proc.communicate()
            continue
        if check(proc.returncode, stdout, stderr):
            clean += 1
        else:
            others.append((i, proc.returncode, stdout[:20], stderr[-300:]))
    return tries, clean, hangs, others


COUNT = 50_000


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_sweep_signals_over_verify_and_fuse_of_many_tensors(tmp_path, rng, sig):
    model, lora = many_tensors(tmp_path, rng, COUNT)
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], fused)

    def verified(code, stdout, stderr):
        return (code == CODES[sig] and stderr.strip().splitlines() == [LINES[sig]]) or (
            code == 0 and stderr.strip() == "" and stdout.startswith("verified"))

    out = tmp_path / "out.safetensors"

    def fused_or_not(code, stdout, stderr):
        lines = stderr.strip().splitlines()
        there = out.exists()
        ok = (code == CODES[sig] and lines == [LINES[sig]] and not there) or (
            code == 0 and there and complete(out) == COUNT and stdout.startswith("fused ")
            and lines in ([], [f"ltx2blas: {sig} came after the output was complete: {out} "
                                "is written in full and in place"]))
        ok = ok and temps(tmp_path) == []
        if there:
            out.unlink()
        return ok

    results = {}
    for what, args, check, reset in [
            ("verify", ["verify", fused, "-q"], verified, lambda: None),
            ("verify --model --lora", ["verify", fused, "--model", model, "--lora", lora, "-q"],
             verified, lambda: None),
            ("fuse", ["fuse", model, "--lora", lora, "-o", out, "-q"], fused_or_not,
             lambda: out.unlink())]:
        results[what] = sweep(args, sig, check, reset=reset)
        tries, clean, hangs, others = results[what]
        print(f"{what}, {sig}: {tries} tries, {clean} clean, {hangs} hangs; others: {others}")
    assert all(clean == tries and not hangs for tries, clean, hangs, _ in results.values())
