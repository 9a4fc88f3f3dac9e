"""safetensors files, read strictly and written safely.

Format (spec §5): 8-byte little-endian header length N, N bytes of JSON, then the data.  Every
entry ``{"dtype", "shape", "data_offsets": [begin, end]}`` is relative to the data start;
``__metadata__`` is a string-to-string map.

Reading validates the whole header before any tensor byte is touched, and refuses what the
reference reader refuses (N > 100,000,000; offsets that do not tile the data from 0 with no
gap, overlap or trailing byte; a byte length other than prod(shape) x itemsize) and more:
duplicate keys, unknown fields and dtypes, non-integer sizes, more than a million tensors.
Tensors are read with pread into buffers, never memory-mapped, so a file that shrinks after it
was opened gives a clear error instead of SIGBUS, and the memory they take is only what the
caller holds.

Writing goes to a temporary file in the destination folder, fsynced, renamed over the
destination, and the folder fsynced: an interrupted write leaves the old output, or none, and
no temporary file.  Where the file system allows, the data goes out with O_DIRECT from two
aligned staging buffers, written by a background thread while the caller computes the next
tensor: a checkpoint's worth of output does not have to pass through (and evict) the page cache.
"""
import errno
import json
import os
import shutil
import stat
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, Ltx2IOError

MAX_HEADER = 100_000_000
MAX_TENSORS = 1_000_000

#: dtype name -> itemsize. BF16, F8_* come back as their uint bits.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
NUMPY_DTYPE = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8,
               "F8_E5M2": np.uint8, "I16": np.int16, "U16": np.uint16, "F16": np.float16,
               "BF16": np.uint16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
               "I64": np.int64, "U64": np.uint64, "F64": np.float64}
_ALIGN = 8  # the header is padded with spaces to a multiple of this, as the reference does


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple
    begin: int  # absolute file offset
    end: int

    @property
    def nbytes(self):
        return self.end - self.begin

    @property
    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def open_regular(path, what="file"):
    """An fd for reading a regular file, or Ltx2IOError naming the path (a directory, FIFO,
    device or dangling link is refused without blocking or reading)."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise Ltx2IOError(exc.errno, f"cannot open {what} {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else
                    "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or other special file")
            raise Ltx2IOError(errno.EINVAL, f"{what} {path} is {kind}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread_exact(fd, n, offset, path):
    """Exactly n bytes at offset, or Ltx2IOError (the file is shorter than it said)."""
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise Ltx2IOError(errno.EIO, f"{path}: expected {n} bytes at offset {offset}, got "
                                     f"{len(data)}; the file was truncated")
    return data


def read_into(fd, buffer, offset, path):
    """Fill ``buffer`` (a writable numpy array) from offset; Ltx2IOError on a short read."""
    view = memoryview(buffer.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:done + (1 << 30)]], offset + done)
        except OSError as exc:
            raise Ltx2IOError(exc.errno, f"{path}: read failed at offset {offset + done}: "
                                         f"{exc.strerror}") from exc
        if n == 0:
            raise Ltx2IOError(errno.EIO, f"{path}: the file ends at offset {offset + done}, "
                                         f"{len(view) - done} bytes early; it was truncated")
        done += n


class SafetensorsFile:
    """A validated safetensors file: ``tensors`` (name -> TensorInfo, in file order),
    ``metadata`` (dict), and ``read(name)`` / ``read_into(name, array)`` for the data."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._fd = open_regular(self.path, "safetensors file")
        try:
            self.size = os.fstat(self._fd).st_size
            self._parse_header()
        except BaseException:
            self.close()
            raise

    # -- header --------------------------------------------------------------------------

    def _fail(self, message):
        raise FormatError(f"{self.path}: {message}")

    def _parse_header(self):
        if self.size < 8:
            self._fail(f"{self.size} bytes: too short to hold the 8-byte header length")
        n = int.from_bytes(pread_exact(self._fd, 8, 0, self.path), "little")
        if n > MAX_HEADER:
            self._fail(f"header length {n} exceeds the limit of {MAX_HEADER}")
        if 8 + n > self.size:
            self._fail(f"header length {n} runs past the end of the {self.size}-byte file")
        raw = pread_exact(self._fd, n, 8, self.path)
        if raw.count(b'"data_offsets"') > MAX_TENSORS:
            self._fail(f"more than {MAX_TENSORS} tensors in the header")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._fail(f"header is not UTF-8 ({exc.reason} at byte {exc.start})")

        def pairs(items):
            keys = [k for k, _ in items]
            if len(set(keys)) != len(keys):
                dup = next(k for k in keys if keys.count(k) > 1)
                self._fail(f"duplicate key {dup!r} in the header")
            return dict(items)

        def constant(name):
            self._fail(f"header holds {name}, which is not JSON")

        try:
            header = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
        except json.JSONDecodeError as exc:
            self._fail(f"header is not valid JSON: {exc.msg} at character {exc.pos}")
        except RecursionError:
            self._fail("header nests JSON too deeply to be a safetensors header")
        if not isinstance(header, dict):
            self._fail(f"header is a JSON {type(header).__name__}, not an object")
        self.data_start = 8 + n
        data_len = self.size - self.data_start

        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            self._fail("__metadata__ must be a map of strings to strings")
        self.metadata = meta

        infos = []
        for name, entry in header.items():
            infos.append(self._entry(name, entry, data_len))
        # The data must be tiled exactly: from 0, no gap, no overlap, nothing after.
        position = 0
        for info in sorted(infos, key=lambda i: (i.begin, i.end)):
            if info.begin - self.data_start != position:
                kind = "overlaps the one before" if info.begin - self.data_start < position else \
                    "leaves a gap before it" if position else "does not start the data at 0"
                self._fail(f"tensor {info.name!r}: data_offsets {kind}")
            position = info.end - self.data_start
        if position != data_len:
            self._fail(f"{data_len - position} bytes after the last tensor's data" if
                       position < data_len else "the data section is truncated")
        self.tensors = {i.name: i for i in sorted(infos, key=lambda i: i.begin)}

    def _entry(self, name, entry, data_len):
        where = f"tensor {name!r}"
        if not isinstance(entry, dict):
            self._fail(f"{where}: entry is not an object")
        if set(entry) != {"dtype", "shape", "data_offsets"}:
            extra = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
            missing = sorted({"dtype", "shape", "data_offsets"} - set(entry))
            self._fail(f"{where}: " + (f"missing field(s) {missing}" if missing else
                                       f"unknown field(s) {extra}"))
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            self._fail(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 2**63 for d in shape):
            self._fail(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                _is_int(v) and 0 <= v < 2**63 for v in offsets)):
            self._fail(f"{where}: data_offsets {offsets!r} is not two non-negative integers")
        begin, end = offsets
        if end < begin:
            self._fail(f"{where}: data_offsets end {end} is before begin {begin}")
        numel = 1
        for d in shape:
            numel *= d
        if numel * ITEMSIZE[dtype] != end - begin:
            self._fail(f"{where}: {end - begin} bytes of data, but shape {shape} of {dtype} needs "
                       f"{numel * ITEMSIZE[dtype]}")
        if end > data_len:
            self._fail(f"{where}: data_offsets end {end} is past the end of the data ({data_len})")
        return TensorInfo(name, dtype, tuple(shape), self.data_start + begin,
                          self.data_start + end)

    # -- data ----------------------------------------------------------------------------

    def read(self, name, out=None):
        """The tensor as a numpy array (BF16 and F8 as their uint bits), read now."""
        info = self.tensors[name]
        array = np.empty(info.shape, NUMPY_DTYPE[info.dtype]) if out is None else out
        if array.nbytes != info.nbytes:
            raise ValueError(f"buffer of {array.nbytes} bytes for {name!r} ({info.nbytes})")
        read_into(self._fd, array, info.begin, self.path)
        return array

    def fileno(self):
        return self._fd

    def close(self):
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def header_bytes(entries, metadata):
    """The serialized header for ``entries`` (name, dtype, shape, nbytes) laid out in order,
    padded with spaces to a multiple of 8 bytes; returns (bytes, data offsets)."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    offsets = []
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % _ALIGN)
    return len(body).to_bytes(8, "little") + body, offsets, offset


TEMP_MARK = ".ltx2blas-tmp-"


def clean_stale_temps(destination):
    """Remove temporary files a killed writer left beside ``destination`` (their pid is dead)."""
    folder, base = os.path.split(os.path.abspath(destination))
    prefix = f".{base}{TEMP_MARK}"
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for entry in names:
        if not entry.startswith(prefix):
            continue
        try:
            pid = int(entry[len(prefix):].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # a live writer
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(folder, entry))
            removed.append(entry)
        except OSError:
            pass
    return removed


class _BufferedSink:
    """Plain write(2) to the file, in order."""

    def __init__(self, fd, path):
        self.fd, self.path = fd, path

    def append(self, data):
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            try:
                done += os.write(self.fd, view[done:done + (1 << 30)])
            except OSError as exc:
                raise Ltx2IOError(exc.errno, f"writing {self.path} failed: {exc.strerror}") from exc

    def append_owned(self, data, release):
        self.append(data)
        release()

    def finish(self, size):
        pass

    def close(self):
        pass


def page_aligned(nbytes, alignment=4096):
    """An uninitialised uint8 array of nbytes whose data starts on an ``alignment`` boundary."""
    raw = np.empty(nbytes + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


class _DirectSink:
    """O_DIRECT writes of CHUNK-byte blocks from two aligned staging buffers: the caller fills
    one while a background thread writes the other.  The last, partial block is padded to the
    alignment and the file truncated back to its size.  ``append_owned`` hands whole pages of
    the caller's own memory to the background thread instead, without a copy."""

    CHUNK = 32 << 20
    ALIGN = 4096

    def __init__(self, fd, path):
        self.fd, self.path = fd, path
        self.buffers = [page_aligned(self.CHUNK), page_aligned(self.CHUNK)]
        self.free = [threading.Semaphore(1), threading.Semaphore(1)]
        self.current, self.fill, self.offset = 0, 0, 0
        self.error = None
        self.pending = []
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="ltx2blas-writer", daemon=True)
        self.closing = False
        self.free[0].acquire()
        self.thread.start()

    def _run(self):
        while True:
            with self.lock:
                while not self.pending and not self.closing:
                    self.lock.wait()
                if not self.pending:
                    return
                data, offset, on_done = self.pending.pop(0)
            try:
                if self.error is None:
                    view = memoryview(data)
                    done = 0
                    while done < len(view):
                        done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                self.error = exc
            finally:
                on_done()

    def _queue(self, data, on_done):
        with self.lock:
            self.pending.append((data, self.offset, on_done))
            self.lock.notify()
        self.offset += len(data)

    def _submit(self, length):
        self._queue(self.buffers[self.current][:length], self.free[self.current].release)
        self.current ^= 1
        self.free[self.current].acquire()  # wait until the writer is done with it
        self.fill = 0
        self._raise()

    def _raise(self):
        if self.error is not None:
            exc, self.error = self.error, None
            raise Ltx2IOError(exc.errno, f"writing {self.path} failed: {exc.strerror}") from exc

    def append(self, data):
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(len(view) - done, self.CHUNK - self.fill)
            self.buffers[self.current][self.fill:self.fill + n] = np.frombuffer(view[done:done + n], np.uint8)
            self.fill += n
            done += n
            if self.fill == self.CHUNK:
                self._submit(self.CHUNK)

    def append_owned(self, data, release):
        """Append ``data``, writing its whole pages from where they lie when it sits at the same
        offset from a page boundary in memory as in the file; ``release()`` is called once
        nothing more will be read from it (from the writer thread, or before returning).
        ``data`` must not change until then."""
        view = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        head = (-(self.offset + self.fill)) % self.ALIGN
        whole = max(0, len(view) - head) // self.ALIGN * self.ALIGN
        if whole == 0 or (view.ctypes.data + head) % self.ALIGN:
            self.append(view)
            release()
            return
        self.append(view[:head])  # completes the staging buffer's last page
        if self.fill:
            self._submit(self.fill)
        self._queue(view[head:head + whole], release)
        self.append(view[head + whole:])
        self._raise()

    def finish(self, size):
        if self.fill:
            padded = -(-self.fill // self.ALIGN) * self.ALIGN
            self.buffers[self.current][self.fill:padded] = 0
            self._submit(padded)
        self.close()
        self._raise()
        try:
            os.ftruncate(self.fd, size)
        except OSError as exc:
            raise Ltx2IOError(exc.errno, f"finishing {self.path} failed: {exc.strerror}") from exc

    def close(self):
        with self.lock:
            self.closing = True
            self.lock.notify()
        self.thread.join()


class SafetensorsWriter:
    """Writes a safetensors file: header first, then each tensor's bytes in the declared order,
    to a temporary file that ``commit()`` makes the destination atomically.  Used as a context
    manager, an exception (KeyboardInterrupt included) removes the temporary file."""

    def __init__(self, path, entries, metadata=None, check_space=True, direct=True):
        self.path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(self.path)
        if os.path.isdir(self.path):
            raise Ltx2IOError(errno.EISDIR, f"output {self.path} is a directory")
        if not os.path.isdir(folder):
            raise Ltx2IOError(errno.ENOENT, f"output folder {folder} does not exist")
        self.entries = list(entries)
        self._header, self.offsets, data_len = header_bytes(self.entries, metadata)
        self.size = len(self._header) + data_len
        clean_stale_temps(self.path)
        if check_space:
            free = shutil.disk_usage(folder).free
            if free < self.size:
                raise Ltx2IOError(errno.ENOSPC, f"{folder} has {free} bytes free; the output needs "
                                                f"{self.size}")
        self.temp = os.path.join(folder, f".{os.path.basename(self.path)}{TEMP_MARK}"
                                         f"{os.getpid()}-{os.urandom(4).hex()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(self.temp, flags, 0o644)
        except OSError as exc:
            raise Ltx2IOError(exc.errno, f"cannot create a file in {folder}: {exc.strerror}") from exc
        self._sink = _BufferedSink(self._fd, self.path)
        if direct and hasattr(os, "O_DIRECT") and self.size >= _DirectSink.CHUNK:
            try:  # file systems without O_DIRECT (tmpfs, some FUSE) refuse it: stay buffered
                import fcntl

                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) | os.O_DIRECT)
                probe = page_aligned(_DirectSink.ALIGN)
                os.pwrite(self._fd, probe, 0)
                os.ftruncate(self._fd, 0)
                self._sink = _DirectSink(self._fd, self.path)
            except OSError:
                import fcntl

                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._index = 0
        self._sink.append(self._header)

    def _next(self, name, nbytes):
        if self._index >= len(self.entries):
            raise ValueError(f"{name!r}: every declared tensor was already written")
        want = self.entries[self._index]
        if want[0] != name or want[3] != nbytes:
            raise ValueError(f"expected {want[0]!r} ({want[3]} bytes) next, got {name!r} ({nbytes})")
        self._index += 1

    #: Page size of direct writes: an array passed to write() with ``release`` that starts at
    #: file_offset(name) % ALIGN past a page boundary is written without a copy.
    ALIGN = _DirectSink.ALIGN

    def file_offset(self, name):
        """Where the data of tensor ``name`` starts in the file."""
        if not hasattr(self, "_index_of"):
            self._index_of = {entry[0]: i for i, entry in enumerate(self.entries)}
        return len(self._header) + self.offsets[self._index_of[name]]

    def write(self, name, array, release=None):
        """The next tensor's data from a C-contiguous array (its raw bytes).  Without
        ``release`` the bytes are taken before this returns; with it, the array may be written
        from where it lies, must not change until ``release()`` is called (from the writer's
        thread, or before this returns), and is not referenced after."""
        array = np.ascontiguousarray(array)
        self._next(name, array.nbytes)
        data = array.reshape(-1).view(np.uint8)
        if release is not None:
            self._sink.append_owned(data, release)
        elif array.nbytes:
            self._sink.append(data)

    def copy(self, name, source_fd, offset, nbytes, source_path="input"):
        """The next tensor's data copied byte for byte from another file."""
        self._next(name, nbytes)
        done = 0
        while done < nbytes:
            chunk = os.pread(source_fd, min(nbytes - done, 1 << 26), offset + done)
            if not chunk:
                raise Ltx2IOError(errno.EIO, f"{source_path} ended early; it was truncated")
            self._sink.append(chunk)
            done += len(chunk)

    def set_metadata(self, metadata):
        """Replace the header's metadata before commit(); the new header must serialize to the
        same length (for values known only at the end, written first as same-length
        placeholders)."""
        header, _, _ = header_bytes(self.entries, metadata)
        if len(header) != len(self._header):
            raise ValueError(f"new header is {len(header)} bytes, the written one {len(self._header)}")
        self._header_patch = header

    def commit(self):
        if self._index != len(self.entries):
            raise ValueError(f"{len(self.entries) - self._index} declared tensors not written")
        self._sink.finish(self.size)
        try:
            patch = getattr(self, "_header_patch", None)
            if patch is not None:
                import fcntl

                if hasattr(os, "O_DIRECT"):
                    flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                    fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                view = memoryview(patch)
                done = 0
                while done < len(view):
                    done += os.pwrite(self._fd, view[done:], done)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.temp, self.path)
            dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise Ltx2IOError(exc.errno, f"finishing {self.path} failed: {exc.strerror}") from exc

    def abort(self):
        if getattr(self, "_sink", None) is not None:
            self._sink.close()
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or self._fd >= 0:
            self.abort()
        return False
