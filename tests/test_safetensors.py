"""The safetensors reader and writer: round trips with the reference package both ways, and
strict refusal of malformed or hostile files (RELIABILITY.md rows 1-12, 26-28)."""
import json
import os
import struct

import numpy as np
import pytest

from ltx2blas import errors
from ltx2blas.files.safetensors import SafetensorsFile, SafetensorsWriter, clean_stale_temps

st = pytest.importorskip("safetensors.numpy")


def tensors(rng):
    return {
        "a.weight": rng.integers(0, 65535, (3, 5), dtype=np.uint16),
        "b.bias": rng.standard_normal(7).astype(np.float32),
        "c": np.zeros((0, 4), np.float32),
        "d.scalar": np.array(2.5, np.float32),
        "e.codes": rng.integers(0, 255, (4, 4), dtype=np.uint8),
    }


def raw_file(path, header, data=b"", header_len=None):
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


def test_reads_what_the_reference_writes(tmp_path, rng):
    ts = tensors(rng)
    st.save_file(ts, str(tmp_path / "m.safetensors"), metadata={"k": "v"})
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        assert f.metadata == {"k": "v"}
        assert set(f.tensors) == set(ts)
        for name, value in ts.items():
            assert np.array_equal(f.read(name), value)


def test_reference_reads_what_we_write(tmp_path, rng):
    ts = tensors(rng)
    dtypes = {np.dtype(np.uint16): "U16", np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    entries = [(n, dtypes[v.dtype], v.shape, v.nbytes) for n, v in ts.items()]
    out = tmp_path / "ours.safetensors"
    with SafetensorsWriter(out, entries, {"x": "y"}) as w:
        for n, v in ts.items():
            w.write(n, v)
        w.commit()
    back = st.load_file(str(out))
    assert set(back) == set(ts)
    for n, v in ts.items():
        assert np.array_equal(back[n], v)
    from safetensors import safe_open

    with safe_open(str(out), "numpy") as f:
        assert f.metadata() == {"x": "y"}
    assert (os.path.getsize(out) - 8 - int.from_bytes(out.read_bytes()[:8], "little")) == \
        sum(v.nbytes for v in ts.values())
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


OK_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_bytes(b""), "too short"),
    (lambda p: p.write_bytes(b"\x01" * 7), "too short"),
    (lambda p: p.write_bytes(struct.pack("<Q", 2**63) + b"{}"), "exceeds the limit"),
    (lambda p: p.write_bytes(struct.pack("<Q", 100_000_001) + b"{}"), "exceeds the limit"),
    (lambda p: p.write_bytes(struct.pack("<Q", 50) + b"{}"), "runs past the end"),
    (lambda p: raw_file(p, b"\xff\xfe{}"), "not UTF-8"),
    (lambda p: raw_file(p, b"{\"a\": "), "not valid JSON"),
    (lambda p: raw_file(p, b"[1, 2]"), "not an object"),
    (lambda p: raw_file(p, b'{"a": NaN}'), "not JSON"),
    (lambda p: raw_file(p, b'{"a": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}',
                        b"\0" * 4), "shape"),
    (lambda p: raw_file(p, b'{"a": {"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                           b' "a": {"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 8),
     "duplicate key"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, dtype="F12")}, b"\0" * 8), "unknown dtype"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, dtype="bf16")}, b"\0" * 8), "unknown dtype"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, dtype=["F32"])}, b"\0" * 8), "unknown dtype"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=[-1])}, b"\0" * 8), "shape"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=[1.0, 2])}, b"\0" * 8), "shape"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=[True, 2])}, b"\0" * 8), "shape"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=["2"])}, b"\0" * 8), "shape"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=None)}, b"\0" * 8), "shape"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=[2**64])}, b"\0" * 8), "shape"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=[2**32, 2**32])}, b"\0" * 8), "overflows"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, data_offsets=[0])}, b"\0" * 8), "data_offsets"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, data_offsets=[8, 0])}, b"\0" * 8), "before begin"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, data_offsets=[4, 12])}, b"\0" * 12),
     "does not start the data at 0"),
    (lambda p: raw_file(p, {"a": OK_ENTRY, "b": dict(OK_ENTRY, data_offsets=[12, 20])},
                        b"\0" * 20), "gap"),
    (lambda p: raw_file(p, {"a": OK_ENTRY, "b": dict(OK_ENTRY, data_offsets=[4, 12])},
                        b"\0" * 12), "overlaps"),
    (lambda p: raw_file(p, {"a": OK_ENTRY, "b": OK_ENTRY}, b"\0" * 8), "overlaps"),
    (lambda p: raw_file(p, {"a": OK_ENTRY}, b"\0" * 9), "after the last tensor"),
    (lambda p: raw_file(p, {"a": OK_ENTRY}, b"\0" * 5), "past the end of the data"),
    (lambda p: raw_file(p, {"a": dict(OK_ENTRY, shape=[3])}, b"\0" * 8), "needs"),
    (lambda p: raw_file(p, {"__metadata__": {"k": 1}, "a": OK_ENTRY}, b"\0" * 8), "__metadata__"),
    (lambda p: raw_file(p, {"__metadata__": "x", "a": OK_ENTRY}, b"\0" * 8), "__metadata__"),
])
def test_malformed_files_are_refused(tmp_path, make, message):
    path = tmp_path / "bad.safetensors"
    make(path)
    before = path.read_bytes()
    with pytest.raises(errors.FormatError, match=message) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == before


def test_many_header_entries_stay_bounded(tmp_path):
    """A header that declares more tensors than any checkpoint has is refused before parsing."""
    entry = b'"t%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
    body = b"{" + b"".join(entry % i for i in range(1_000_001))[:-1] + b"}"
    path = raw_file(tmp_path / "many.safetensors", body)
    with pytest.raises(errors.FormatError, match="more than 1000000 tensors"):
        SafetensorsFile(path)


@pytest.mark.parametrize("kind", ["directory", "fifo", "dev_zero", "dangling", "missing"])
def test_not_a_regular_file(tmp_path, kind):
    path = tmp_path / "x.safetensors"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path = "/dev/zero"
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere", path)
    with pytest.raises(errors.Ltx2IOError):
        SafetensorsFile(path)


def test_file_truncated_after_opening(tmp_path, rng):
    ts = {"w": rng.standard_normal((256, 256)).astype(np.float32)}
    path = tmp_path / "t.safetensors"
    st.save_file(ts, str(path))
    with SafetensorsFile(path) as f:
        os.truncate(path, os.path.getsize(path) - 1000)
        with pytest.raises(errors.Ltx2IOError, match="truncated"):
            f.read("w")


def test_writer_removes_its_temp_file_on_error(tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old output")
    with pytest.raises(RuntimeError):
        with SafetensorsWriter(out, [("a", "F32", (2,), 8)]) as w:
            raise RuntimeError("interrupted")
    assert out.read_bytes() == b"old output"
    assert os.listdir(tmp_path) == ["out.safetensors"]
    with SafetensorsWriter(out, [("a", "F32", (2,), 8)]) as w:
        with pytest.raises(ValueError, match="expected 'a'"):
            w.write("b", np.zeros(2, np.float32))
    assert os.listdir(tmp_path) == ["out.safetensors"]


def test_writer_refuses_bad_destinations(tmp_path):
    with pytest.raises(errors.Ltx2IOError, match="is a directory"):
        SafetensorsWriter(tmp_path, [])
    with pytest.raises(errors.Ltx2IOError, match="does not exist"):
        SafetensorsWriter(tmp_path / "no" / "x.safetensors", [])


def test_stale_temp_files_of_dead_writers_are_cleaned(tmp_path):
    out = tmp_path / "out.safetensors"
    stale = tmp_path / ".out.safetensors.ltx2blas-tmp-999999999-abcd"
    stale.write_bytes(b"partial")
    live = tmp_path / f".out.safetensors.ltx2blas-tmp-{os.getpid()}-abcd"
    live.write_bytes(b"in progress")
    assert clean_stale_temps(out) == [stale.name]
    assert live.exists() and not stale.exists()


def test_direct_writes_from_the_callers_memory(tmp_path, rng, monkeypatch):
    """Arrays handed over with ``release`` at their file offset's place within a page are
    written from where they lie, the rest copied; every byte lands, every release is called
    once. Small chunks, so that a few hundred KiB take the O_DIRECT path."""
    from ltx2blas.files import safetensors as st

    monkeypatch.setattr(st._DirectSink, "CHUNK", 1 << 16)
    queued = []
    queue = st._DirectSink._queue
    monkeypatch.setattr(st._DirectSink, "_queue",
                        lambda self, data, on_done: (queued.append(data), queue(self, data, on_done)))
    sizes = [5, 3 * 4096 + 7, 70000, 1, 200000, 8192, 4095, 100000]
    data = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
    entries = [(f"t{i}", "U8", (n,), n) for i, n in enumerate(sizes)]
    path = tmp_path / "out.safetensors"
    released = []
    buffers = []
    with SafetensorsWriter(path, entries, {"note": "direct"}) as writer:
        if not isinstance(writer._sink, st._DirectSink):
            pytest.skip("this file system refuses O_DIRECT")
        for i, values in enumerate(data):
            # Even tensors at their page offset (written in place), odd ones one byte off (copied).
            shift = (writer.file_offset(f"t{i}") + i % 2) % writer.ALIGN
            buffer = st.page_aligned(values.size + writer.ALIGN)
            buffer[shift:shift + values.size] = values
            buffers.append(buffer)
            writer.write(f"t{i}", buffer[shift:shift + values.size],
                         release=lambda i=i: released.append(i))
        writer.commit()
    assert sorted(released) == list(range(len(sizes)))
    in_place = {i for i, b in enumerate(buffers) if any(np.shares_memory(q, b) for q in queued)}
    assert in_place == {2, 4}  # the even tensors with at least one whole page past the first
    with SafetensorsFile(path) as f:
        assert f.metadata == {"note": "direct"}
        for i, values in enumerate(data):
            assert np.array_equal(f.read(f"t{i}"), values)


def test_a_large_copy_goes_through_the_writers_own_buffers(tmp_path):
    """A tensor of at least COPY_CHUNK bytes copied to a direct (O_DIRECT) output: read into the
    writer's two page-aligned buffers at the offset its bytes have in the output, written and
    hashed from there -- the bytes and digests as a plain copy's, whatever the offsets (an
    odd-sized tensor before it, a size that is no whole number of pages or chunks)."""
    from ltx2blas.files import provenance
    from ltx2blas.files.safetensors import SafetensorsFile, SafetensorsWriter

    rng = np.random.default_rng(7)
    big = SafetensorsWriter.COPY_CHUNK * 4 + 4099  # past the size from which it writes directly
    tensors = {"a": rng.integers(0, 256, 3, dtype=np.uint8),
               "b": rng.integers(0, 256, big, dtype=np.uint8),
               "c": rng.integers(0, 256, 5, dtype=np.uint8)}
    source = tmp_path / "in.safetensors"
    with SafetensorsWriter(source, [(n, "U8", v.shape, v.nbytes) for n, v in tensors.items()],
                           direct=False) as w:
        for n, v in tensors.items():
            w.write(n, v)
        w.commit()
    out = tmp_path / "out.safetensors"
    with SafetensorsFile(source) as f, provenance.Hasher(2) as hasher:
        entries = [(n, "U8", tuple(i.shape), i.nbytes) for n, i in f.tensors.items()]
        with SafetensorsWriter(out, entries, hasher=hasher) as w:
            direct = type(w._sink).__name__ == "_DirectSink"
            for n, i in f.tensors.items():
                w.copy(n, f.fileno(), i.begin, i.nbytes, f.path)
            digests = w.digests()
            w.commit()
    if not direct:
        pytest.skip("this folder's file system takes no O_DIRECT writes")
    with SafetensorsFile(out) as f:
        for n, v in tensors.items():
            assert f.read(n).tobytes() == v.tobytes(), n
            assert digests[n] == provenance.digest_of(v), n
