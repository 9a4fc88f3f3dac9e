"""What Arm's BF16 instructions compute (docs/arithmetic.md, "Arm's BF16 instructions"),
established element by element against IEEE f32 steps written in C (tests/arm/bf16_rules.c).
Runs on aarch64 where the CPU has BF16 -- under qemu-user with QEMU_CPU=max, which follows the
Architecture Reference Manual's pseudo-code (.ci/arm runs it so), and on Arm hardware, where
it checks that the silicon does as the pseudo-code says."""
import os
import platform
import shutil
import subprocess

import pytest

from ltx2blas import info

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arm", "bf16_rules.c")
HWCAP2_BF16 = 1 << 14

#: rule -> whether every case must match it (docs/arithmetic.md says why each does or not)
RULES = {"bfmlalb": True, "bfmlalt": True, "bfmlalb_textbook_exact": True, "bfcvt": True,
         "bfdot_ro": True, "bfmmla_ro": True, "bfdot_textbook": False}


def _bf16_cpu():
    if platform.machine().lower() not in ("aarch64", "arm64"):
        return "an aarch64 CPU (on x86-64: bash .ci/arm runs this under qemu-user)"
    hwcap2 = info._arm_sources()[1]
    if not hwcap2 & HWCAP2_BF16:
        return "a CPU with BF16 (HWCAP2_BF16 unset; under qemu-user, QEMU_CPU=max has it)"
    if not (shutil.which("cc") or shutil.which("gcc")):
        return "a C compiler to build the probe"
    return None


@pytest.mark.skipif(_bf16_cpu() is not None, reason=f"needs {_bf16_cpu()}")
def test_bf16_instructions_compute_the_stated_rules(tmp_path):
    exe = tmp_path / "bf16_rules"
    cc = shutil.which("cc") or shutil.which("gcc")
    # no contraction: the C reference steps are the IEEE operations written
    subprocess.run([cc, "-std=c11", "-O1", "-ffp-contract=off", "-march=armv8.6-a+bf16",
                    "-o", str(exe), SOURCE, "-lm"], check=True, timeout=600)
    r = subprocess.run([str(exe), "20000"], capture_output=True, text=True, timeout=1200,
                       check=True)
    seen = {}
    for line in r.stdout.splitlines():
        name, cases, bad, *first = line.split(" ", 3)
        seen[name] = (int(cases), int(bad), first[0] if first else "")
    assert set(seen) == set(RULES)
    for name, exact in RULES.items():
        cases, bad, first = seen[name]
        assert cases >= 80_000
        if exact:
            assert bad == 0, f"{name}: {bad} of {cases} differ, first {first}"
        else:   # BFDOT is not two textbook steps: its sums round to odd, subnormals flushed
            assert bad > cases // 10, f"{name}: only {bad} of {cases} differ"


@pytest.mark.skipif(_bf16_cpu() is not None, reason=f"needs {_bf16_cpu()}")
def test_the_bf16_table_is_chosen_where_the_cpu_has_bf16():
    """Where the kernel reports HWCAP2_BF16, the neon_bf16 table serves (so the kernel tests
    run what users run), with its dot-product fuse and Linear and their rule."""
    from ltx2blas import _gemm
    assert "neon_bf16" in _gemm.kernels_built()
    assert _gemm.kernel_name() == "neon_bf16"
    assert _gemm.has_pairs_kernel() and _gemm.has_dot_linear()
    assert _gemm.dot_rule() == (4, 4)   # 4 lanes; two round-to-odd steps a pair
    text = info.format_info(info.collect(probe_depths=(32,)))
    assert "kernels    neon_bf16" in text and "BFMLALT" in text and "BFMMLA" in text
