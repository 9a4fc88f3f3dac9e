"""The command line: ``ltx2blas info`` and ``ltx2blas demo`` (run as a user would)."""
import json
import os
import subprocess
import sys


def run(*args):
    # From /, so that a checkout's ltx2blas/ folder cannot shadow the installed package.
    return subprocess.run([sys.executable, "-m", "ltx2blas", *args], capture_output=True,
                          text=True, cwd="/", timeout=300)


def test_info_reports_blas_threads_and_depth():
    out = run("info")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("ltx2blas", "blas", "threads", "kernels", "sgemm probed now", "rank   384"):
        assert needle in text


def test_info_json():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["threads_default"] >= 1
    assert info["blas"]["library"]
    depths = info["sgemm_exact_depth"]["by_rank"]
    assert set(depths) == {"32", "384", "450", "512"}
    assert all(0 <= d <= int(k) for k, d in depths.items())


def test_info_shows_the_route_of_each_rank_and_row_count():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    routes = info["fuse_routes"]
    # the dot-product kernel takes every rank where the table has it and it measured faster;
    # the other routes stand for adapters whose magnitudes rule it out, and elsewhere
    pairs = info["dot_product_fuse"] and info["fuse_kernel"] == "dot"
    assert routes["32"] == {"sgemm_exact": info["sgemm_exact_depth"]["by_rank"]["32"],
                            "sgemm_terms": 0, "otherwise": "one-pass",
                            "route": "dot-product" if pairs else "one-pass"}
    for rank, route in routes.items():
        terms = route["sgemm_terms"]
        # sgemm takes a product only where it is exact for at least half of its terms
        assert terms == 0 or route["sgemm_exact"] >= terms >= info["sgemm_min_share"] * int(rank)
        assert route["otherwise"] == ("one-pass" if terms == 0 else
                                      "sgemm" if terms == int(rank) else "sgemm+sequential")
        assert route["route"] == ("dot-product" if pairs else route["otherwise"])
    linear = info["linear_routes"]
    # the panel kernel from the table's panel_min_rows (48 on AVX2, where it was measured)
    from ltx2blas import _gemm
    at_64 = "panel" if 0 < _gemm.panel_min_rows() <= 64 else "stream"
    assert [linear[m]["route"] for m in ("1", "8", "64", "256", "1024")] == \
        ["stream", "stream", at_64] + 2 * [
            "panel" if info["linear_panel_above_stream_rows"] else "sgemm"]
    # the in-dimension's segments bring every real shape to 256 tasks or more
    assert all(t >= 256 for m in linear.values() for t in m["tasks"].values())
    assert linear["1"]["segments"]["2048"] == 1 and linear["8"]["segments"]["2048"] == 16
    text = run("info").stdout
    assert "rank   384: " in text and "M     1: stream" in text



def test_info_shows_the_bf16_x_routes_the_linear_takes():
    """On bf16 x the routes info reports are plan's, and on a table with the dot-product
    Linear its text names each row count's route and how dot_panel takes x."""
    import numpy as np
    from ltx2blas import _gemm
    from ltx2blas.linear_layer import plan
    info = json.loads(run("info", "--json").stdout)
    bf16 = np.dtype(np.uint16)
    routes = info["linear_routes_bf16_x"]
    assert routes == {m: plan(int(m), bf16, x_dtype=bf16)[0] for m in routes}
    text = run("info").stdout
    if _gemm.has_dot_linear():
        assert routes["1"] == "dot" and routes["1024"] == "dot_panel"
        assert "M 64: " + routes["64"] in text and "dot_panel packs x into pairs" in text
    else:
        assert "on bf16 x" not in text

def test_demo_checks_and_times():
    out = run("demo", "--rows", "256", "--cols", "512", "--rank", "64", "--threads", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("byte-identical") == 2  # in memory, and through files
    assert "of the sgemm rate" in out.stdout
    assert "fused 4 modules" in out.stdout
    folder = [w for w in out.stdout.split() if "ltx2blas-demo-" in w][0]
    assert not os.path.exists(folder)  # cleaned up


def test_user_error_exits_2_without_a_traceback():
    out = run("demo", "--rows", "16", "--cols", "16", "--rank", "4", "--threads", "0")
    assert out.returncode == 2
    assert "--threads: expected a positive integer, got 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_help():
    out = run("--help")
    assert out.returncode == 0 and "demo" in out.stdout and "info" in out.stdout


def test_version_is_the_installed_distribution_s():
    from importlib.metadata import version

    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ltx2blas {version('ltx2blas')}"


def test_kernel_table_chosen_by_environment():
    env = dict(os.environ, LTX2BLAS_KERNELS="base")
    out = subprocess.run([sys.executable, "-m", "ltx2blas", "info", "--json"], capture_output=True,
                         text=True, cwd="/", timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kernel"] == "base"

    env["LTX2BLAS_KERNELS"] = "no-such-table"
    out = subprocess.run([sys.executable, "-m", "ltx2blas", "info"], capture_output=True,
                         text=True, cwd="/", timeout=300, env=env)
    assert out.returncode == 2
    assert "kernel table 'no-such-table' is not available here" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_source_folder_shadowing_the_installed_package_says_so(tmp_path):
    """Python run from a checkout's root imports its ltx2blas/ folder, which has the source but
    no compiled modules: the import says so and what to do, in one traceback of one error, and
    the command in one line."""
    import shutil

    import ltx2blas

    installed = os.path.dirname(os.path.abspath(ltx2blas.__file__))
    source = tmp_path / "ltx2blas"
    shutil.copytree(installed, source, ignore=lambda folder, names: [
        n for n in names if not n.endswith(".py") and not os.path.isdir(os.path.join(folder, n))])
    assert not [p for p in source.rglob("*") if p.is_file() and p.suffix != ".py"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # cwd first on the path
    said = (f"ltx2blas was imported from {source.resolve()}, which holds its source but not its "
            "compiled extension modules")
    hints = ("shadows the installed package", "Run Python from another directory",
             "pip install .", "`pytest` from the root")

    out = subprocess.run([sys.executable, "-c", "import ltx2blas"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: " + said), out.stderr
    assert all(hint in last for hint in hints), out.stderr
    assert out.stderr.count("Traceback") == 1 and "direct cause" not in out.stderr, out.stderr
    assert "cannot import name" not in out.stderr, out.stderr

    out = subprocess.run([sys.executable, "-m", "ltx2blas", "info"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 1 and said in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
