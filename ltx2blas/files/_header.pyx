"""The safetensors header checks that run once per entry, compiled.

A header may hold a million entries; the same checks in Python take three times as long as the
JSON parse itself, so a hostile header would be judged far slower than the reference reader
judges it.  Each function here only says *whether* an entry is well formed; what is wrong with
one that is not is worked out, once, by :mod:`ltx2blas.files.safetensors`.
"""
from cpython.long cimport PyLong_AsUnsignedLongLong, PyLong_CheckExact
from cpython.unicode cimport PyUnicode_CheckExact
from libc.stdint cimport uint64_t

cdef extern from *:
    bint __builtin_mul_overflow(uint64_t a, uint64_t b, uint64_t *product) nogil


class DuplicateKey(Exception):
    """A JSON object repeats a key (args[0])."""


def object_pairs(list items):
    """``json``'s object_pairs_hook: the pairs as a dict, or DuplicateKey for the first repeated
    key.  The dict is built in C; only when it came out shorter are the keys searched, once."""
    cdef dict out = dict(items)
    cdef set seen
    if len(out) != len(items):
        seen = set()
        for key, _ in items:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return out


cdef class TensorInfo:
    """One header entry, validated: name, dtype, shape (a tuple), and the absolute file offsets
    [begin, end) of its bytes."""
    cdef readonly str name
    cdef readonly str dtype
    cdef readonly tuple shape
    cdef readonly uint64_t begin
    cdef readonly uint64_t end
    cdef readonly Py_ssize_t order  # position in the header, to keep file order stable

    def __init__(self, name, dtype, shape, begin, end, order=0):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self.begin, self.end, self.order = begin, end, order

    @property
    def nbytes(self):
        return self.end - self.begin

    def __repr__(self):
        return (f"TensorInfo(name={self.name!r}, dtype={self.dtype!r}, shape={self.shape}, "
                f"begin={self.begin}, end={self.end})")

    def __eq__(self, other):
        if not isinstance(other, TensorInfo):
            return NotImplemented
        return self._key() == (<TensorInfo>other)._key()

    def __hash__(self):
        return hash(self._key())

    cdef tuple _key(self):
        return (self.name, self.dtype, self.shape, self.begin, self.end)


cdef bint _u64(object v, uint64_t *out):
    """Whether v is a plain int in 0 .. 2^64 - 1 (bool and int subclasses are not)."""
    if not PyLong_CheckExact(v):
        return False
    try:
        out[0] = PyLong_AsUnsignedLongLong(v)
    except OverflowError:
        return False
    return True


cdef TensorInfo _quick_entry(object name, object entry, dict bits, uint64_t data_start,
                             uint64_t data_len, Py_ssize_t order):
    """The entry as a TensorInfo, or None when any check fails."""
    cdef uint64_t d = 0, numel = 1, nbits = 0, begin = 0, end = 0
    cdef list shape, offsets
    cdef TensorInfo info
    if not PyUnicode_CheckExact(name) or type(entry) is not dict:
        return None
    if not (<str>name).isascii():  # only a non-ASCII name can hold a lone surrogate
        try:
            (<str>name).encode("utf-8")
        except UnicodeEncodeError:
            return None
    dtype = (<dict>entry).get("dtype")
    shape_obj = (<dict>entry).get("shape")
    offsets_obj = (<dict>entry).get("data_offsets")
    if not PyUnicode_CheckExact(dtype) or type(shape_obj) is not list \
            or type(offsets_obj) is not list:
        return None
    width = bits.get(dtype)
    if width is None:
        return None
    shape = <list>shape_obj
    for v in shape:
        if not _u64(v, &d):
            return None
        if __builtin_mul_overflow(numel, d, &numel):
            return None
    if __builtin_mul_overflow(numel, <uint64_t>(<int>width), &nbits) or nbits % 8:
        return None
    offsets = <list>offsets_obj
    if len(offsets) != 2 or not _u64(offsets[0], &begin) or not _u64(offsets[1], &end):
        return None
    if end < begin or end - begin != nbits // 8 or end > data_len:
        return None
    info = TensorInfo.__new__(TensorInfo)
    info.name, info.dtype, info.shape = name, dtype, tuple(shape)
    info.begin, info.end, info.order = data_start + begin, data_start + end, order
    return info


def _file_order(TensorInfo info):
    return (info.begin, info.end, info.order)


def read_entries(dict header, dict bits, uint64_t data_start, uint64_t data_len):
    """The header's entries checked one by one and then for tiling the data exactly:
    ``(tensors, None)`` with tensors a dict of name -> TensorInfo in file order, or ``(None, fault)`` where fault is
    ``("entry", name)`` for the first malformed entry, ``("start" | "gap" | "overlap", name)``
    for the first that breaks the tiling, or ``("after", n)`` / ``("truncated", n)`` for data
    left over or missing at the end."""
    cdef list infos = []
    cdef dict tensors = {}
    cdef TensorInfo info
    cdef Py_ssize_t order = 0
    cdef uint64_t position = 0, begin
    for name, entry in header.items():
        info = _quick_entry(name, entry, bits, data_start, data_len, order)
        if info is None:
            return None, ("entry", name)
        infos.append(info)
        order += 1
    infos.sort(key=_file_order)
    for info in infos:
        begin = info.begin - data_start
        if begin != position:
            kind = "overlap" if begin < position else "gap" if position else "start"
            return None, (kind, info.name)
        position = info.end - data_start
        tensors[info.name] = info
    if position != data_len:
        return None, (("after", data_len - position) if position < data_len else
                      ("truncated", position - data_len))
    return tensors, None
