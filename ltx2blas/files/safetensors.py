"""safetensors files, read strictly and written safely.

Format (docs/arithmetic.md §5): 8-byte little-endian header length N, N bytes of JSON, then the data.  Every
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
import contextlib
import errno
import gc
import json
import os
import resource
import shutil
import stat
import sys
import threading
import numpy as np

from .. import _stop
from ..errors import ArgumentError, FormatError, Ltx2IOError
from ._header import DuplicateKey, object_pairs, read_entries
from ._header import TensorInfo  # noqa: F401  (the type of SafetensorsFile.tensors' values)

MAX_HEADER = 100_000_000
MAX_TENSORS = 1_000_000

#: dtype name -> bits per element: every dtype the reference reader takes.  Tensors of any of
#: them are copied byte for byte; NUMPY_DTYPE names those that can be read as arrays.
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
        "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
        "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
        "U64": 64}
#: dtype name -> itemsize of the dtypes read as arrays. BF16, F8_* come back as their uint bits.
ITEMSIZE = {name: bits // 8 for name, bits in BITS.items() if bits % 8 == 0}
NUMPY_DTYPE = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8,
               "F8_E5M2": np.uint8, "F8_E8M0": np.uint8, "F8_E4M3FNUZ": np.uint8,
               "F8_E5M2FNUZ": np.uint8, "I16": np.int16, "U16": np.uint16, "F16": np.float16,
               "BF16": np.uint16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
               "C64": np.complex64, "I64": np.int64, "U64": np.uint64, "F64": np.float64}
_ALIGN = 8  # the header is padded with spaces to a multiple of this, as the reference does
_U64 = 2**64


def byte_size(dtype, shape):
    """Bytes of a tensor of ``dtype`` and ``shape`` as the reference counts them, or None if
    the count overflows 64 bits or ends in a fraction of a byte."""
    numel = 1
    for d in shape:
        numel *= d
        if numel >= _U64:
            return None
    bits = numel * BITS[dtype]
    if bits >= _U64 or bits % 8:
        return None
    return bits // 8


def _encodable(text):
    """Whether a header string is valid Unicode (no lone surrogates, which the reference's JSON
    parser refuses)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


class _NotJSON(Exception):
    pass


def _refuse_constant(name):
    raise _NotJSON(f"holds {name}, which is not JSON")


@contextlib.contextmanager
def gc_paused():
    """The cyclic collector off for a block that builds millions of small containers (a large
    header): each collection would walk all of them again, which more than doubles the time.
    Nothing built there is cyclic; the collector is switched back on only if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


#: The most separators (commas, colons, opening brackets) a JSON text may hold to be parsed,
#: counted before parsing, inside strings too.  The strict parse holds at most about 70 bytes
#: of Python objects per separator (measured up to 52), so a text costs at most 3 x its size
#: plus about 280 MB; an LTX-2 checkpoint's header has about 12 per tensor (300,000 fit).
MAX_JSON_SEPARATORS = 4_000_000


def parse_json(text, fail, what):
    """A header or index as Python objects, strictly: duplicate keys, NaN and Infinity,
    integers longer than any size, nesting past Python's limit and texts of more than
    MAX_JSON_SEPARATORS separators are refused through ``fail(message)``, which raises."""
    separators = text.count(",") + text.count(":") + text.count("[") + text.count("{")
    if separators > MAX_JSON_SEPARATORS:
        fail(f"{what} holds {separators} JSON separators (commas, colons, brackets); the limit "
             f"is {MAX_JSON_SEPARATORS}, which keeps parsing it within about 300 MB")
    try:
        return json.loads(text, object_pairs_hook=object_pairs, parse_constant=_refuse_constant)
    except DuplicateKey as exc:
        fail(f"{what} has a duplicate key {exc.args[0]!r}")
    except _NotJSON as exc:
        fail(f"{what} {exc}")
    except json.JSONDecodeError as exc:
        fail(f"{what} is not valid JSON: {exc.msg} at character {exc.pos}")
    except RecursionError:
        fail(f"{what} nests JSON too deeply")
    except ValueError as exc:  # Python's own limit on an integer's digits, or else
        if "digits" in str(exc):
            fail(f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                 "larger than any size or offset")
        fail(f"{what} is not valid JSON ({exc})")


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
    ``metadata`` (dict), and ``read(name, out=None)`` for the data (into ``out`` when given)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._fd = open_regular(self.path, "safetensors file")
        try:
            self.size = os.fstat(self._fd).st_size
            with gc_paused():
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
        if n > MAX_HEADER or 8 + n > self.size:
            first = os.pread(self._fd, 1, 8)
            if first not in (b"{", b" ", b"\n", b"\t", b"\r"):
                self._fail(f"not a safetensors file: its first 8 bytes, read as a header length, "
                           f"give {n}, and no JSON header follows")
            if n > MAX_HEADER:
                self._fail(f"header length {n} exceeds the limit of {MAX_HEADER}")
            self._fail(f"header length {n} runs past the end of the {self.size}-byte file")
        raw = pread_exact(self._fd, n, 8, self.path)
        if raw.count(b'"data_offsets"') > MAX_TENSORS:
            self._fail(f"more than {MAX_TENSORS} tensors in the header")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._fail(f"header is not UTF-8 ({exc.reason} at byte {exc.start})")
        header = parse_json(text, self._fail, "header")
        if not isinstance(header, dict):
            self._fail(f"header is a JSON {type(header).__name__}, not an object")
        self.data_start = 8 + n
        data_len = self.size - self.data_start

        meta = header.pop("__metadata__", None)
        if meta is None:  # null, as the reference accepts
            meta = {}
        if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            self._fail("__metadata__ must be a map of strings to strings")
        for k, v in meta.items():
            if not (_encodable(k) and _encodable(v)):
                self._fail(f"__metadata__ entry {k!r} is not valid Unicode (a lone surrogate)")
        self.metadata = meta
        # Counted after parsing: a field spelled with JSON escapes is the same field.
        if len(header) > MAX_TENSORS:
            self._fail(f"{len(header)} tensors in the header; the limit is {MAX_TENSORS}")

        self.tensors, fault = read_entries(header, BITS, self.data_start, data_len)
        if fault is not None:
            self._describe(fault, header, data_len)

    def _describe(self, fault, header, data_len):
        """Fail with what is wrong, for a fault found by read_entries."""
        kind, what = fault
        if kind == "entry":
            self._entry_fault(what, header[what], data_len)
        if kind in ("start", "gap", "overlap"):
            kind = {"start": "does not start the data at 0", "gap": "leaves a gap before it",
                    "overlap": "overlaps the one before"}[kind]
            self._fail(f"tensor {what!r}: data_offsets {kind}")
        self._fail(f"{what} bytes after the last tensor's data" if kind == "after"
                   else "the data section is truncated")

    def _entry_fault(self, name, entry, data_len):
        """Say what is wrong with an entry the quick check refused."""
        where = f"tensor {name!r}"
        if not _encodable(name):
            self._fail(f"tensor name {name!r} is not valid Unicode (a lone surrogate)")
        if not isinstance(entry, dict):
            self._fail(f"{where}: entry is not an object")
        missing = sorted({"dtype", "shape", "data_offsets"} - set(entry))
        if missing:  # other fields are ignored, as the reference ignores them
            self._fail(f"{where}: missing field(s) {missing}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in BITS:
            self._fail(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
            self._fail(f"{where}: shape {shape!r} is not a list of integers")
        for d in shape:
            if not 0 <= d < _U64:
                self._fail(f"{where}: shape entry {d} is outside 0 .. 2^64 - 1")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                _is_int(v) for v in offsets)):
            self._fail(f"{where}: data_offsets {offsets!r} is not two integers")
        begin, end = offsets
        if not (0 <= begin < _U64 and 0 <= end < _U64):
            self._fail(f"{where}: data_offsets {offsets} are outside 0 .. 2^64 - 1")
        if end < begin:
            self._fail(f"{where}: data_offsets end {end} is before begin {begin}")
        size = byte_size(dtype, shape)
        if size is None:
            self._fail(f"{where}: shape {shape} of {dtype} has a byte size that overflows 64 "
                       "bits or is not a whole number of bytes")
        if size != end - begin:
            self._fail(f"{where}: {end - begin} bytes of data, but shape {shape} of {dtype} needs "
                       f"{size}")
        if end > data_len:
            self._fail(f"{where}: data_offsets end {end} is past the end of the data ({data_len})")
        self._fail(f"{where}: not a valid entry")

    # -- data ----------------------------------------------------------------------------

    def read(self, name, out=None):
        """The tensor as a numpy array (BF16 and F8 as their uint bits), read now."""
        info = self.tensors[name]
        if out is None:
            if info.dtype not in NUMPY_DTYPE:
                raise FormatError(f"{self.path}: tensor {name!r} is {info.dtype}, which ltx2blas "
                                  "copies but does not read as an array")
            try:
                array = np.empty(info.shape, NUMPY_DTYPE[info.dtype])
            except (ValueError, OverflowError) as exc:
                raise FormatError(f"{self.path}: tensor {name!r}: shape {list(info.shape)} "
                                  f"cannot be held as an array ({exc})") from None
        else:
            array = out
        if array.nbytes != info.nbytes:
            raise ArgumentError(f"buffer of {array.nbytes} bytes for {name!r} ({info.nbytes})")
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
    padded with spaces to a multiple of 8 bytes: (the length prefix and header bytes, each
    entry's data offset, the data's total length)."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    offsets = []
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % _ALIGN)
    return len(body).to_bytes(8, "little") + body, offsets, offset


def check_entries(entries, metadata):
    """Refuse, before anything is written, a header the reference reader would refuse: an
    unknown dtype, a byte count that is not the shape's, metadata that is not strings."""
    for name, dtype, shape, nbytes in entries:
        if not isinstance(name, str) or not _encodable(name) or name == "__metadata__":
            raise FormatError(f"tensor name {name!r} cannot be written to a safetensors header")
        if dtype not in BITS:
            raise FormatError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if byte_size(dtype, shape) != nbytes:
            raise FormatError(f"tensor {name!r}: {nbytes} bytes, but shape {list(shape)} of "
                              f"{dtype} needs {byte_size(dtype, shape)}")
    for key, value in (metadata or {}).items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise FormatError(f"metadata {key!r}: {value!r} is not a string; safetensors "
                              "metadata maps strings to strings")
        if not (_encodable(key) and _encodable(value)):
            raise FormatError(f"metadata {key!r} is not valid Unicode (a lone surrogate)")


def output_path(path):
    """The file an output path names: a symbolic link is followed to its target (the link
    then names the new file); anything there other than a regular file -- a folder, a device,
    a FIFO, a socket -- is refused, as is a missing folder."""
    given = os.fspath(path)
    path = os.path.abspath(given)
    try:  # what the path names, through any links (/dev/stdout names a pipe or a terminal)
        st = os.stat(path)
    except FileNotFoundError:
        st = None  # nothing there yet, or a dangling link: its target is created
    except OSError as exc:
        raise Ltx2IOError(exc.errno, f"output {given}: {exc.strerror}") from exc
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise Ltx2IOError(errno.EISDIR, f"output {given} is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (a pipe)" if stat.S_ISFIFO(st.st_mode) else "a socket" if
                stat.S_ISSOCK(st.st_mode) else "a device or other special file")
        raise Ltx2IOError(errno.EINVAL, f"output {given} is {kind}, not a regular file; "
                                        "ltx2blas writes a new file and replaces only files")
    if os.path.islink(path):
        path = os.path.realpath(path)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise Ltx2IOError(errno.ENOENT, f"output folder {folder} does not exist")
    return path


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


def wait_in_steps(event):
    """Wait for a buffer a writer holds, in steps, so that a signal is seen between them."""
    while not event.wait(0.1):
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
        self.cancelled = False
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
                if self.error is None and not self.cancelled:
                    view = memoryview(data)
                    done = 0
                    while done < len(view) and not self.cancelled:
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

    def abort(self):
        """Drop what is queued; True once the background thread is done with the file (then
        its descriptor may be closed).  The wait is short and bounded: after a stop the thread
        may wait for ever on a lock the interrupted main thread left held."""
        self.cancelled = True
        if self.lock.acquire(timeout=0.1):
            try:
                self.closing = True
                self.pending.clear()
                self.lock.notify()
            finally:
                self.lock.release()
        self.thread.join(0.25)
        return not self.thread.is_alive()


def _after_both(release):
    """``release``, called on the second of two calls: a buffer both hashed and written is
    released once neither is reading it."""
    lock, calls = threading.Lock(), [0]

    def call():
        with lock:
            calls[0] += 1
            last = calls[0] == 2
        if last:
            release()
    return call


class SafetensorsWriter:
    """Writes a safetensors file: header first, then each tensor's bytes in the declared order,
    to a temporary file that ``commit()`` makes the destination atomically.  Used as a context
    manager, an exception (KeyboardInterrupt included) removes the temporary file."""

    def __init__(self, path, entries, metadata=None, check_space=True, direct=True,
                 hasher=None):
        """``hasher``: a provenance.Hasher that every tensor's bytes go to as they are written
        (SHA-256, in the background, under the tensor's name); its owner closes it."""
        self.path = output_path(path)
        self._hasher = hasher
        folder = os.path.dirname(self.path)
        self.entries = list(entries)
        check_entries(self.entries, metadata)
        self._header, self.offsets, data_len = header_bytes(self.entries, metadata)
        if len(self._header) - 8 > MAX_HEADER:
            raise FormatError(f"output {self.path}: its header would be {len(self._header) - 8} "
                              f"bytes, past the {MAX_HEADER}-byte limit readers enforce")
        self.size = len(self._header) + data_len
        clean_stale_temps(self.path)
        if check_space:
            free = shutil.disk_usage(folder).free
            if free < self.size:
                raise Ltx2IOError(errno.ENOSPC, f"{folder} has {free} bytes free; the output needs "
                                                f"{self.size}")
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY and limit < self.size:
                raise Ltx2IOError(errno.EFBIG, f"the file size limit (ulimit -f) is {limit} bytes; "
                                               f"the output needs {self.size}")
        self.temp = os.path.join(folder, f".{os.path.basename(self.path)}{TEMP_MARK}"
                                         f"{os.getpid()}-{os.urandom(4).hex()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self._sink = None
        try:
            self._fd = os.open(self.temp, flags, 0o644)
        except OSError as exc:
            self._fd = -1
            raise Ltx2IOError(exc.errno, f"cannot create a file in {folder}: {exc.strerror}") from exc
        _stop.temps.add(self.temp)  # removed by the watchdog where a stop's clean-up hangs
        # From here the temporary file exists: whatever fails before the caller holds the
        # writer (its buffers' allocation, the header's write) must take the file and its
        # descriptor with it, as __exit__ would.
        try:
            self._sink = self._open_sink(direct)
            self._index = 0
            self._sink.append(self._header)
        except BaseException:
            self.abort()
            raise

    def _open_sink(self, direct):
        if not (direct and hasattr(os, "O_DIRECT") and self.size >= _DirectSink.CHUNK):
            return _BufferedSink(self._fd, self.path)
        import fcntl

        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:  # file systems without O_DIRECT (tmpfs, some FUSE) refuse it: stay buffered
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            os.pwrite(self._fd, page_aligned(_DirectSink.ALIGN), 0)
            os.ftruncate(self._fd, 0)
        except OSError:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            return _BufferedSink(self._fd, self.path)
        return _DirectSink(self._fd, self.path)

    def _next(self, name, nbytes):
        if self._index >= len(self.entries):
            raise ArgumentError(f"{name!r}: every declared tensor was already written")
        want = self.entries[self._index]
        if want[0] != name or want[3] != nbytes:
            raise ArgumentError(f"expected {want[0]!r} ({want[3]} bytes) next, got {name!r} ({nbytes})")
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
        if self._hasher is not None:
            if release is None:  # the caller may change the array once this returns
                self._hasher.hash_now(name, data)
            else:  # released once both the hash and the write are done with it
                release = _after_both(release)
                self._hasher.add(name, data, on_done=release)
        if release is not None:
            self._sink.append_owned(data, release)
        elif array.nbytes:
            self._sink.append(data)

    #: Bytes a copy reads at a time into one of the writer's two copy buffers (a tensor of at
    #: least this much, to a direct sink, goes through them; smaller ones through the sink's
    #: staging).
    COPY_CHUNK = 8 << 20

    def copy(self, name, source_fd, offset, nbytes, source_path="input"):
        """The next tensor's data copied byte for byte from another file."""
        self._next(name, nbytes)
        done = 0
        if self._hasher is not None and not nbytes:
            self._hasher.add(name, b"")
        if isinstance(self._sink, _DirectSink) and nbytes >= self.COPY_CHUNK:
            self._copy_owned(name, source_fd, offset, nbytes, source_path)
            return
        while done < nbytes:
            chunk = os.pread(source_fd, min(nbytes - done, 1 << 24), offset + done)
            if not chunk:
                raise Ltx2IOError(errno.EIO, f"{source_path} ended early; it was truncated")
            self._sink.append(chunk)
            done += len(chunk)
            if self._hasher is not None:  # bytes do not change: hashed in the background
                self._hasher.add(name, chunk, last=done == nbytes)

    def _copy_owned(self, name, source_fd, offset, nbytes, source_path):
        """A large tensor copied through two page-aligned buffers of the writer's own, each read
        into at the offset from a page boundary its bytes have in the output, so that the
        sink writes their whole pages from there (no staging copy) while the other is read;
        each is hashed from there too, and read into again once both are done with it."""
        if not hasattr(self, "_copy_buffers"):
            self._copy_buffers = [(page_aligned(self.COPY_CHUNK + self.ALIGN),
                                   threading.Event()) for _ in range(2)]
            for _, free in self._copy_buffers:
                free.set()
            self._copy_turn = 0
        done, position = 0, self.file_offset(name)
        while done < nbytes:
            memory, free = self._copy_buffers[self._copy_turn]
            self._copy_turn ^= 1
            wait_in_steps(free)
            free.clear()
            at = (position + done) % self.ALIGN
            n = min(nbytes - done, self.COPY_CHUNK - at)
            view = memory[at:at + n]
            try:
                read_into(source_fd, view, offset + done, source_path)
            except BaseException:
                free.set()
                raise
            done += n
            release = free.set
            if self._hasher is not None:
                release = _after_both(release)
                self._hasher.add(name, view, last=done == nbytes, on_done=release)
            self._sink.append_owned(view, release)

    def digests(self):
        """{tensor: SHA-256 of its bytes} of every tensor written so far (with a hasher)."""
        digests = self._hasher.wait()
        return {entry[0]: digests[entry[0]] for entry in self.entries[:self._index]}

    def set_metadata(self, metadata):
        """Replace the header's metadata before commit(); the new header must serialize to the
        same length (for values known only at the end, written first as same-length
        placeholders)."""
        header, _, _ = header_bytes(self.entries, metadata)
        if len(header) != len(self._header):
            raise ArgumentError(f"new header is {len(header)} bytes, the written one {len(self._header)}")
        self._header_patch = header

    def commit(self):
        if self._index != len(self.entries):
            raise ArgumentError(f"{len(self.entries) - self._index} declared tensors not written")
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
            # Everything that can fail is done before the rename: after it the output is in
            # place, and nothing may turn that into an error.
            try:
                dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
            except OSError as exc:
                raise Ltx2IOError(exc.errno, f"cannot open the output folder "
                                             f"{os.path.dirname(self.path)} to make the new file "
                                             f"durable: {exc.strerror}") from exc
            try:
                # the commit point (README, "Errors and exit codes"): a stop signal before it
                # leaves the destination as it was; one after it finds the output complete
                _stop.commit_rename(self.temp, self.path)
            except BaseException:
                os.close(dir_fd)
                raise
        except OSError as exc:
            raise Ltx2IOError(exc.errno, f"finishing {self.path} failed: {exc.strerror}") from exc
        try:
            os.fsync(dir_fd)
        except OSError:
            pass  # the file is complete and in place; only the rename's durability is at stake
        finally:
            os.close(dir_fd)

    def abort(self):
        """Remove the temporary file.  Waits only briefly for the background writer: where it
        is not done with the descriptor, the descriptor is left open rather than closed under
        it (a number reused by another open would take its writes)."""
        sink_done = True
        if getattr(self, "_sink", None) is not None:
            sink_done = self._sink.abort() if hasattr(self._sink, "abort") else True
        if getattr(self, "_fd", -1) >= 0 and sink_done:
            os.close(self._fd)
        self._fd = -1
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass
        _stop.temps.discard(self.temp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or self._fd >= 0:
            self.abort()
        return False
