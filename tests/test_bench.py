"""The benchmark suite must keep working: run ``bench/run.py --quick`` (one thread) and check
that every workload produced rows, every row was checked against the reference, and the
report and plots were written, part by part, and that a stopped run keeps what it finished
and leaves no empty folder.  Its timings are not judged here; the harness's rules are checked
on a fake clock."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench", "run.py")


def test_tile_route_and_segment_benchmarks_run_and_check_their_results(tmp_path):
    folder = os.path.dirname(BENCH)
    segments = ["--width", str(49 * 400), "--out-features", "64", "--feature-out", "40",
                "--rows", "3,8,70", "--tokens", "8,70", "--repeats", "1"]
    for script, args in (("bench_tiles.py", ["--ranks", "4", "--shapes", "200x300"]),
                         ("bench_routes.py", ["--ranks", "150", "--shapes", "256x256"]),
                         ("bench_segments.py", segments)):
        out = tmp_path / (script + ".json")
        r = subprocess.run([sys.executable, os.path.join(folder, script), "--threads", "1", *args,
                            "--out", str(out)], capture_output=True, text=True, cwd="/",
                           timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        rows = json.loads(out.read_text())["rows"]
        assert rows and all(row["same_bytes"] and row.get("within_bound", True) for row in rows)
    out = tmp_path / "linear_routes.json"
    r = subprocess.run([sys.executable, os.path.join(folder, "bench_linear_routes.py"), "--threads",
                        "1", "--rows", "48,80", "--outs", "40", "--width", "3000", "--out",
                        str(out)], capture_output=True, text=True, cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # the panel route against the streaming kernel up to 64 rows, against sgemm above
    assert [row["checked"] for row in rows] == [{"panel": True, "stream": True},
                                                {"panel": True, "sgemm": True}]
    # the steps of one fuse call, and the model from them
    out = tmp_path / "steps.json"
    r = subprocess.run([sys.executable, os.path.join(folder, "bench_steps.py"), "--threads", "1,2",
                        "--cases", "256x320:8,256x320:40:fp8", "--repeats", "2", "--out",
                        str(out)], capture_output=True, text=True, cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["format"] for row in rows] == ["bf16", "fp8"] and all(r["checked"] for r in rows)
    for row in rows:
        assert set(row["seconds"]["1"]) == {"validate", "route", "pin", "plan", "run", "call",
                                            "read_weight"}
        assert 0 < row["model"]["16"]["efficiency"] <= 1.0 + 1e-9
        assert 0 < row["steps_model"]["16"]["efficiency"] <= 1.0 + 1e-9
        # a loaded machine can time the run (the call less its steps) as nothing: then the
        # memory rate is not given
        needs = row["steps_model"]["16"]["needs_gbs"]
        assert (needs is None) == (row["seconds"]["1"]["run"] == 0) and (needs is None or needs > 0)
        assert row["speedup"]["read_weight"] > 0
    # the parts of a bf16-x Linear with many rows, five segments in passes (the dot-product
    # panel route only: elsewhere the script says so and has no rows)
    out = tmp_path / "linear_parts.json"
    r = subprocess.run([sys.executable, os.path.join(folder, "bench_linear_parts.py"), "--threads",
                        "1,2", "--rows", "40", "--out-features", "300", "--width",
                        str(4 * 12288 + 300), "--repeats", "1", "--save", str(out)],
                       capture_output=True, text=True, cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["parts"]
    from ltx2blas import _gemm
    assert len(rows) == (2 if _gemm.has_dot_linear() else 0)
    assert all(row["same_bytes"] and set(row["seconds"]) == {
        "call", "reused", "one_pass", "one_pass_reused", "first_pass"} for row in rows)
    # its text_features part, on small hidden states
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_linear_routes as b; "
            "rows = b.run_features([1], 8, depth=64, layers=3, outs=(40, 24), repeats=1); "
            "sys.exit(0 if rows and all(all(r['checked'].values()) for r in rows) else 1)")
    r = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True,
                       cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_quick_suite_runs_every_part(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, BENCH, "--quick", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the estimate first, then each part's rows as they come and its results written as it ends
    lines = r.stdout.splitlines()
    assert lines[0].startswith("bench: fuse, linear, checkpoint, features at threads 1 (quick): "
                               "about ") and str(out) in lines[0]
    for index, (name, rows) in enumerate((("fuse", 2), ("linear", 3), ("checkpoint", 1),
                                          ("features", 1)), 1):
        step = f"part {index}/4 {name}"
        assert any(f"] {step}: {rows} row{'s' if rows > 1 else ''}, about " in line
                   for line in lines)
        assert any(f"] {step}, row {rows}/{rows}: {name} " in line for line in lines)
        assert any(f"] {step} done in " in line and str(out) in line for line in lines)
    results = json.loads((out / "results.json").read_text())
    workloads = {row["workload"] for row in results["rows"]}
    assert workloads == {"fuse", "linear", "checkpoint", "features"}
    assert [p["workload"] for p in results["parts"]] == ["fuse", "linear", "checkpoint", "features"]
    assert results["complete"] and results["not_run"] == []
    assert all(row["checked"] for row in results["rows"])
    assert results["ceilings"][0]["sgemm_gflops"] > 0 and results["ceilings"][0]["read_gbs"] > 0
    # the register-only FMA peak (every CPU has one; a C compiler is there, as it built us)
    # and each fuse row read against its instruction's peak
    peaks = results["ceilings"][0]["peaks_gflops"]
    assert any(k.startswith("fma_") and v > 0 for k, v in peaks.items())
    assert all(row["of_instruction_peak"] > 0 for row in results["rows"]
               if row["workload"] == "fuse")
    assert {"cpu", "blas", "date", "ltx2blas"} <= set(results["machine"])
    text = (out / "results.md").read_text()
    for section in ("## Ceilings", "## Fuse", "## Linear", "## Checkpoint", "## Text feature"):
        assert section in text
    assert "Not run" not in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for png in ("fuse_threads.png", "linear_threads.png", "checkpoint_threads.png",
                "features_threads.png", "linear_roofline.png"):
        assert (out / png).stat().st_size > 1000


# bench/run.py --quick --threads 1 with one part replaced by a stop (Ctrl-C, or a signal from
# outside) that comes while the part runs; the stop first prints what is on disk by then.
STOPPED = """
import os, signal, sys, time
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import bench_checkpoint, bench_features, bench_fuse, bench_linear, run
only, part, how, out = sys.argv[2:]

def stop(*args, **kwargs):
    print("on disk:", sorted(os.listdir(out)) if os.path.exists(out) else None, flush=True)
    if how == "interrupt":
        raise KeyboardInterrupt
    os.kill(os.getpid(), getattr(signal, how))
    time.sleep(60)

{"fuse": bench_fuse, "linear": bench_linear, "checkpoint": bench_checkpoint,
 "features": bench_features}[part].run = stop
sys.exit(run.main(["--quick", "--threads", "1", "--only", only, "--out", out]))
"""


def run_stopped(only, part, how, out):
    return subprocess.run([sys.executable, "-c", STOPPED, BENCH, only, part, how, str(out)],
                          capture_output=True, text=True, cwd="/", timeout=600)


def test_a_stopped_run_keeps_the_parts_it_finished(tmp_path):
    """Each part's results are on disk before the next part starts: Ctrl-C in the second part
    keeps the first's, says so in one line and exits 130."""
    out = tmp_path / "out"
    r = run_stopped("checkpoint,features", "features", "interrupt", out)
    assert r.returncode == 130, r.stdout[-3000:] + r.stderr[-3000:]
    on_disk = next(line for line in r.stdout.splitlines() if line.startswith("on disk:"))
    assert "'results.json'" in on_disk and "'results.md'" in on_disk
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("bench: interrupted after ")
    assert line.endswith(f"during part 2/2 features; kept checkpoint in {out}")
    results = json.loads((out / "results.json").read_text())
    assert {row["workload"] for row in results["rows"]} == {"checkpoint"}
    assert not results["complete"] and results["not_run"] == ["features"]
    text = (out / "results.md").read_text()
    assert "## Checkpoint" in text and "## Text feature" not in text
    note = "Not run (the run stopped, or was still running, when this was written): features."
    assert f"\n\n{note}\n" in text


@pytest.mark.parametrize("how, code", [("interrupt", 130), ("SIGTERM", 143)])
def test_a_run_stopped_before_any_results_leaves_no_folder(tmp_path, how, code):
    """Stopped in its first part, by Ctrl-C or SIGTERM: no output folder, one line, exit 130 or
    143."""
    out = tmp_path / "out"
    r = run_stopped("features", "features", how, out)
    assert r.returncode == code, r.stdout[-3000:] + r.stderr[-3000:]
    assert "on disk: None" in r.stdout
    (line,) = r.stderr.strip().splitlines()
    assert line.endswith("during part 1/1 features; nothing written")
    assert not out.exists() and os.listdir(tmp_path) == []


def test_upstream_diff_without_torch_says_so_in_one_line():
    """Its comparisons run the owners' arithmetic in torch: without torch, one line naming it
    and a non-zero exit, not a traceback."""
    script = os.path.join(os.path.dirname(BENCH), "upstream_diff.py")
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, script, "--rows", "128", "--cols", "128"],
                       capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode != 0 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "needs torch" in r.stderr and "pip install torch" in r.stderr


class FakeClock:
    """A clock that only the timed calls move, each by a fixed amount: which candidate the
    harness finds slow, and every time it records, cannot depend on the machine's load. The
    amounts are powers of two, so that every sum and difference is exact."""

    def __init__(self):
        self.now = 0.0
        self.calls = {}

    def __call__(self):
        return self.now

    def call(self, name, seconds):
        self.calls[name] = 0

        def fn():
            self.calls[name] += 1
            self.now += seconds
        return fn


def harness_module():
    sys.path.insert(0, os.path.dirname(BENCH))
    import harness
    return harness


def test_a_slow_peer_is_timed_by_its_warm_up_call_alone():
    """harness.interleaved calls a candidate SLOW_PEER times slower than the first one once,
    and keeps that call as its sample; every other candidate gets all its rounds, one just
    under the threshold too."""
    harness = harness_module()
    clock, quick = FakeClock(), 2.0 ** -9
    slow, near = 2 * harness.SLOW_PEER * quick, harness.SLOW_PEER * quick
    t = harness.interleaved({"ours": clock.call("ours", quick), "peer": clock.call("peer", near),
                             "slow": clock.call("slow", slow)},
                            repeats=3, settle=0.0, min_sample=0.0, clock=clock)
    assert clock.calls == {"ours": 4, "peer": 4, "slow": 1}
    assert t["slow"]["n"] == 1 and t["ours"]["n"] == t["peer"]["n"] == 3
    assert (t["ours"]["min"], t["peer"]["min"], t["slow"]["min"]) == (quick, near, slow)


def test_short_calls_are_repeated_within_a_sample():
    """A call shorter than min_sample is repeated back to back within each sample, enough
    times to fill it, and the time per call recorded; min_seconds adds rounds."""
    harness = harness_module()
    clock = FakeClock()
    t = harness.interleaved({"long": clock.call("long", 2.0 ** -2),
                             "short": clock.call("short", 2.0 ** -8)},
                            repeats=2, settle=0.0, min_sample=2.0 ** -5, min_seconds=2.0,
                            clock=clock)
    # 9 calls a sample (2^-5 / 2^-8 + 1), 1 for the long one: rounds of 2^-2 + 9 * 2^-8 s,
    # past 2 s after the eighth
    rounds = 8
    assert clock.calls == {"short": 1 + 9 * rounds, "long": 1 + rounds}
    assert t["short"]["n"] == t["long"]["n"] == rounds
    assert t["short"]["median"] == 2.0 ** -8 and t["long"]["spread"] == 0.0
    assert harness.best_time(clock.call("best", 2.0 ** -4), repeats=3, clock=clock) == 2.0 ** -4


def test_the_steps_model_survives_a_run_timed_as_nothing():
    """On a loaded machine the call can take no longer than its steps timed alone, so the run
    (their difference) is 0: the model says so instead of dividing by it."""
    harness_module()
    import bench_steps
    steps = {s: 1e-5 for s in bench_steps.STEPS}
    timed = {1: {**steps, "run": 0.0, "read_weight": 2e-4},
             2: {**steps, "run": 0.0, "read_weight": 1e-4}}
    out = bench_steps.model(timed, True, 1 << 20)
    assert all(out["steps_model"][str(n)]["needs_gbs"] is None for n in bench_steps.MODEL_THREADS)
    assert out["speedup"]["run"] == 0.0 and out["speedup"]["read_weight"] == 2.0
    assert bench_steps.needs_text(None) == " (the run timed as nothing)"


def test_the_verify_benchmark_runs_and_checks_its_files(tmp_path):
    out = tmp_path / "verify.json"
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(BENCH), "bench_verify.py"),
                        "--blocks", "1", "--scale", "16", "--ranks", "8", "--threads", "1",
                        "--repeats", "1", "--dir", str(tmp_path), "--out", str(out)],
                       capture_output=True, text=True, cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["checked"] and rows[0]["scale"] == 16
    assert set(rows[0]["seconds"]) == {"fuse", "fuse_plain", "verify_file", "verify_rebuild"}


def test_the_lycoris_benchmark_runs_and_checks_its_results(tmp_path):
    out = tmp_path / "lycoris.json"
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(BENCH), "bench_lycoris.py"),
                        "--threads", "1", "--shape", "256x320", "--rank", "8", "--repeats", "1",
                        "--out", str(out)], capture_output=True, text=True, cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["kind"] for row in rows] == ["lora", "loha", "lokr_f8", "lokr_f16"]
    assert all(row["same_bytes"] for row in rows)


def test_the_extract_benchmark_runs(tmp_path):
    out = tmp_path / "extract.json"
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(BENCH), "bench_extract.py"),
                        "--threads", "1,2", "--ranks", "8", "--shape", "200x160", "--repeats",
                        "1", "--blocks", "1", "--scale", "16", "--checkpoint-rank", "8",
                        "--out", str(out)], capture_output=True, text=True, cwd="/", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["workload"] for row in rows] == ["extract"] * 2 + ["extract_checkpoint"] * 2
    assert "side_by_side_seconds" in rows[3] and "side_by_side_seconds" not in rows[2]
    rows = [rows[0], rows[2]]
    # a rank-8 extraction of a decaying spectrum keeps part of it; the checkpoint's tuning is
    # rank 8 (plus the bf16 rounding of the fused weights), nearly all of it kept
    assert 0 < rows[0]["error"] < 1 and rows[1]["least_kept"] > 0.99
