"""`ltx2blas info` on Arm, fed recorded sources: the features from the auxiliary vector, the
cores by kind from MIDR_EL1 or /proc/cpuinfo, on any machine these tests run on."""
from ltx2blas import info

# AT_HWCAP / AT_HWCAP2 bits: asimd 1, asimdhp 10, asimddp 20, sve 22; sve2 1, svebf16 12,
# i8mm 13, bf16 14, sme 23 (Linux's hwcap.h)
GB10_HWCAP = (1 << 0) | (1 << 1) | (1 << 10) | (1 << 20) | (1 << 22) | (1 << 31)
GB10_HWCAP2 = (1 << 1) | (1 << 12) | (1 << 13) | (1 << 14)
# 10 Cortex-X925 (part 0xD85) then 10 Cortex-A725 (0xD87), implementer Arm (0x41)
GB10_MIDR = [0x410FD850] * 10 + [0x410FD870] * 10
# a Neoverse-N1 server as qemu's neoverse-n1 model and Graviton 2 show it: no SVE, no BF16
N1_HWCAP = (1 << 0) | (1 << 1) | (1 << 10) | (1 << 20)
N1_MIDR = [0x413FD0C1] * 64
# a Grace (Neoverse-V2) whose /sys lacks the identification registers: /proc/cpuinfo's lines
GRACE_CPUINFO = "".join(
    f"processor\t: {i}\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd sve sve2 bf16 i8mm\n"
    f"CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd4f\n"
    f"CPU revision\t: 0\n\n" for i in range(72))
# what qemu-user on an x86 host passes through: the host's /proc/cpuinfo
X86_CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n" \
              "flags\t\t: fpu avx2 fma avx512f avx512_bf16\n\n"


def test_a_gb10_s_cores_are_grouped_by_kind():
    cpu, features = info.arm_cpu(GB10_HWCAP, GB10_HWCAP2, GB10_MIDR, X86_CPUINFO)
    assert cpu == "10 x Cortex-X925, 10 x Cortex-A725"
    assert features == ["asimd", "asimdhp", "asimddp", "sve", "sve2", "svebf16", "i8mm", "bf16"]


def test_a_neoverse_n1_has_no_sve_or_bf16():
    cpu, features = info.arm_cpu(N1_HWCAP, 0, N1_MIDR, "")
    assert cpu == "64 x Neoverse-N1" and features == ["asimd", "asimdhp", "asimddp"]


def test_cores_from_cpuinfo_where_sys_has_no_midr():
    assert info.arm_cores([], GRACE_CPUINFO) == "72 x Neoverse-V2"


def test_emulation_names_no_x86_feature_as_the_arm_cpu_s():
    """Under qemu-user /proc/cpuinfo is the host's: no core is named from it, and no x86 flag
    appears among the features, which come from the emulated auxiliary vector alone."""
    cpu, features = info.arm_cpu(N1_HWCAP, 0, [], X86_CPUINFO)
    assert cpu.startswith("cores not named") and "AMD" not in cpu
    assert features == ["asimd", "asimdhp", "asimddp"]


def test_an_unknown_core_is_shown_by_its_numbers():
    assert info.arm_cores([0x4E0F0040] * 2) == "2 x core 0x4e:0x004"


def test_this_machine_s_cpu_line():
    data = info.collect(probe_depths=())
    assert data["cpu"] and isinstance(data["cpu_features"], list)
    if data["machine"].lower() in ("aarch64", "arm64"):
        assert "asimd" in data["cpu_features"]
        assert not {"avx2", "avx512f"} & set(data["cpu_features"])
