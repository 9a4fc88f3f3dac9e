"""Bad input to the fuse: a clear error of the right kind, inputs unchanged, never a wrong
answer."""
import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference

from helpers import random_bf16


@pytest.fixture
def case(rng):
    weight = random_bf16(rng, (12, 20), 0.02)
    lora_a = random_bf16(rng, (4, 20), 0.01)
    lora_b = random_bf16(rng, (12, 4), 0.01)
    return weight, lora_a, lora_b


def unchanged(*arrays):
    copies = [a.copy() for a in arrays]
    return lambda: all(np.array_equal(a, c) for a, c in zip(arrays, copies))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int16, np.int32,
                                   np.complex64, object, ">u2", np.uint8])
@pytest.mark.parametrize("which", ["weight", "lora_a", "lora_b"])
def test_wrong_dtype_is_a_type_error(case, dtype, which):
    weight, lora_a, lora_b = case
    args = {"weight": weight, "lora_a": lora_a, "lora_b": lora_b}
    args[which] = args[which].astype(dtype)
    check = unchanged(weight, lora_a, lora_b)
    with pytest.raises(TypeError, match=which) as info:
        ltx2blas.fuse_lora(args["weight"], args["lora_a"], args["lora_b"], 1.0)
    assert isinstance(info.value, errors.DTypeError)
    assert check()


def test_not_an_array(case):
    weight, lora_a, lora_b = case
    with pytest.raises(TypeError, match="numpy array"):
        ltx2blas.fuse_lora(weight.tolist(), lora_a, lora_b)


@pytest.mark.parametrize("shapes, message", [
    (((12, 20), (4, 21), (12, 4)), "lora_a"),
    (((12, 20), (4, 20), (13, 4)), "lora_b"),
    (((12, 20), (4, 20), (12, 5)), "ranks disagree"),
    (((12, 20, 1), (4, 20), (12, 4)), "2-D"),
    (((240,), (4, 20), (12, 4)), "2-D"),
    (((12, 20), (4, 20, 1), (12, 4)), "2-D"),
    (((12, 20), (80,), (12, 4)), "2-D"),
])
def test_shape_mismatch(shapes, message):
    arrays = [np.zeros(s, np.uint16) for s in shapes]
    with pytest.raises(ValueError, match=message) as info:
        ltx2blas.fuse_lora(*arrays, 1.0)
    assert isinstance(info.value, errors.ShapeError)


def test_zero_dim_array():
    with pytest.raises(errors.ShapeError):
        ltx2blas.fuse_lora(np.array(3, np.uint16), np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16))


@pytest.mark.parametrize("make", [
    lambda a: np.asfortranarray(a),
    lambda a: np.ascontiguousarray(a.T).T,
    lambda a: np.repeat(a, 2, axis=1)[:, ::2],
    lambda a: a[::-1],
], ids=["fortran", "transposed", "strided", "reversed"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_non_contiguous_is_refused_not_copied(case, make, which):
    arrays = list(case)
    arrays[which] = make(arrays[which])
    if arrays[which].flags.c_contiguous:
        pytest.skip("this view happens to be contiguous for this shape")
    with pytest.raises(errors.LayoutError, match="C-contiguous"):
        ltx2blas.fuse_lora(*arrays, 1.0)


def test_read_only_inputs_are_fine(case):
    weight, lora_a, lora_b = case
    for a in case:
        a.flags.writeable = False
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.5)
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, 0.5))


def test_memmap_inputs(case, tmp_path):
    weight, lora_a, lora_b = case
    path = tmp_path / "w.bin"
    weight.tofile(path)
    mapped = np.memmap(path, dtype=np.uint16, mode="r", shape=weight.shape)
    got = ltx2blas.fuse_lora(mapped, lora_a, lora_b, 0.5)
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, 0.5))


def test_misaligned_input(case):
    weight, lora_a, lora_b = case
    raw = np.zeros(weight.size * 2 + 1, np.uint8)
    misaligned = raw[1:].view(np.uint16).reshape(weight.shape)
    misaligned[...] = weight
    assert misaligned.__array_interface__["data"][0] % 2 == 1
    got = ltx2blas.fuse_lora(misaligned, lora_a, lora_b, 0.5)
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, 0.5))


def test_out_faults(case):
    weight, lora_a, lora_b = case
    check = unchanged(weight, lora_a, lora_b)
    with pytest.raises(errors.ShapeError):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, out=np.zeros((12, 21), np.uint16))
    with pytest.raises(errors.DTypeError):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, out=np.zeros((12, 20), np.float32))
    with pytest.raises(errors.LayoutError):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, out=np.zeros((20, 12), np.uint16).T)
    ro = np.zeros((12, 20), np.uint16)
    ro.flags.writeable = False
    with pytest.raises(errors.LayoutError, match="read-only"):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, out=ro)
    big = np.zeros((13, 20), np.uint16)
    big[:12] = weight
    with pytest.raises(errors.LayoutError, match="overlaps weight"):
        ltx2blas.fuse_lora(big[:12], lora_a, lora_b, out=big[1:])
    holder = np.zeros(12 * 20 + 80, np.uint16)
    holder[:80] = lora_a.ravel()
    with pytest.raises(errors.LayoutError, match="overlaps adapter"):
        ltx2blas.fuse_lora(weight, holder[:80].reshape(4, 20), lora_b,
                           out=holder[:240].reshape(12, 20))
    assert check()


def test_rank_zero_leaves_the_weight_unchanged(case):
    weight, _, _ = case
    weight[0, :3] = [0x8000, 0x7FC1, 0xFFFF]  # -0.0 and NaN payloads survive untouched
    got = ltx2blas.fuse_lora(weight, np.zeros((0, 20), np.uint16), np.zeros((12, 0), np.uint16))
    assert np.array_equal(got, weight) and got is not weight
    same = ltx2blas.fuse_lora(weight, np.zeros((0, 20), np.uint16), np.zeros((12, 0), np.uint16),
                              out=weight)
    assert same is weight


def test_zero_size_weight():
    got = ltx2blas.fuse_lora(np.zeros((0, 5), np.uint16), np.zeros((3, 5), np.uint16),
                             np.zeros((0, 3), np.uint16))
    assert got.shape == (0, 5)
    got = ltx2blas.fuse_lora(np.zeros((4, 0), np.uint16), np.zeros((3, 0), np.uint16),
                             np.zeros((4, 3), np.uint16))
    assert got.shape == (4, 0)


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_non_finite_strength(case, strength):
    with pytest.raises(errors.NonFiniteInputError, match="strength"):
        ltx2blas.fuse_lora(*case, strength)


@pytest.mark.parametrize("strength", ["1.0", None, True, [1.0], 1j])
def test_strength_of_the_wrong_type(case, strength):
    with pytest.raises(TypeError, match="strength"):
        ltx2blas.fuse_lora(*case, strength)


@pytest.mark.parametrize("threads, exc", [(0, ValueError), (-2, ValueError), ("2", TypeError),
                                          (1.5, TypeError), (True, TypeError)])
def test_bad_threads(case, threads, exc):
    with pytest.raises(exc, match="threads"):
        ltx2blas.fuse_lora(*case, threads=threads)


def test_check_finite_names_the_adapter_element(case):
    weight, lora_a, lora_b = case
    lora_a[2, 7] = 0x7FC0
    check = unchanged(weight, lora_a, lora_b)
    with pytest.raises(errors.NonFiniteInputError, match=r"lora_a is non-finite at \(2, 7\)"):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, check_finite=True, out=weight)
    assert check()
    lora_a[2, 7] = 0
    lora_b[5, 1] = 0xFF80
    with pytest.raises(errors.NonFiniteInputError, match=r"lora_b is non-finite at \(5, 1\)"):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, check_finite=True)


def test_check_finite_weight_is_a_distinct_error(case):
    weight, lora_a, lora_b = case
    weight[3, 4] = 0x7F80
    with pytest.raises(errors.NonFiniteWeightError, match=r"\(3, 4\)"):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, check_finite=True)
    # without the check the inf simply stays inf
    assert ltx2blas.fuse_lora(weight, lora_a, lora_b)[3, 4] == 0x7F80


def test_check_finite_catches_overflow_before_writing_in_place(rng):
    weight = random_bf16(rng, (30, 40), 1.0)
    weight[4, 9] = 0x7F7F  # the largest bf16: any positive delta overflows it
    lora_a = np.full((2, 40), 0x3F80, np.uint16)  # 1.0
    lora_b = np.full((30, 2), 0x4000, np.uint16)  # 2.0
    before = weight.copy()
    with pytest.raises(errors.NonFiniteResultError, match=r"\(4, 9\)"):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, 1e37, check_finite=True, out=weight)
    assert np.array_equal(weight, before)  # nothing written
    with pytest.raises(errors.NonFiniteResultError, match="overflows bf16"):
        ltx2blas.fuse_lora(weight, lora_a, lora_b, 3e38, check_finite=True)


def test_errors_are_catchable_by_builtin_kind():
    assert issubclass(errors.ShapeError, ValueError)
    assert issubclass(errors.DTypeError, TypeError)
    assert issubclass(errors.NumericsError, ValueError)
    for cls in (errors.ShapeError, errors.DTypeError, errors.LayoutError,
                errors.NonFiniteInputError, errors.NonFiniteWeightError,
                errors.NonFiniteResultError):
        assert issubclass(cls, errors.Ltx2BlasError)


def test_fuse_loras_argument_checks(case):
    weight, lora_a, lora_b = case
    with pytest.raises(TypeError, match="adapters"):
        ltx2blas.fuse_loras(weight, 5)
    with pytest.raises(TypeError, match=r"adapters\[0\]"):
        ltx2blas.fuse_loras(weight, [(lora_a, lora_b, 1.0, 2.0)])
    with pytest.raises(TypeError, match="adapter 0: strength"):  # (diff, strength)
        ltx2blas.fuse_loras(weight, [(lora_a, lora_b)])
    with pytest.raises(errors.ShapeError, match="adapter 1"):
        ltx2blas.fuse_loras(weight, [(lora_a, lora_b, 1.0), (lora_a[:, :5], lora_b, 1.0)])
