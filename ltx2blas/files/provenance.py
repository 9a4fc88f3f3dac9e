"""A fused checkpoint's provenance: what rebuilding it takes, and the SHA-256 digests that name
its inputs and its tensors (docs/verify.md).

A fuse's bytes depend only on its inputs, its options and the arithmetic contract, never on the
machine, the thread count or the tile; so the record below suffices for anyone holding the same
base and adapter files to rebuild the output byte for byte, and to check a file against it.
"""
import collections
import hashlib
import threading

import numpy as np

from .._validate import FP8_OVERFLOWS, FP8_ROUNDINGS, RULES, strength_f32
from ..errors import Ltx2BlasError
from .adapters import ALPHA_MODES
from .safetensors import parse_json, read_into

#: The version of the arithmetic contract (docs/arithmetic.md).  It changes whenever a rule
#: there changes the bytes of some fuse; files fused under another version are not compared.
CONTRACT = 1
#: The version of the record's own layout.
RECORD_FORMAT = 1
RECORD_KEY = "ltx2blas.provenance"
#: The placeholder of a digest not yet known when the header is written first: the same
#: length, so the finished header replaces it in place.
PLACEHOLDER = "0" * 64
#: The options that decide a fuse's bytes, as the record names them.
OPTIONS = ("rule", "alpha", "allow_unmatched", "fp8_rounding", "seed", "fp8_overflow")


def sha256_of(data):
    """The hex SHA-256 of a bytes-like object or a C-contiguous array (hashlib releases the GIL
    on large buffers, so this runs beside other threads)."""
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


class Hasher:
    """SHA-256 of named byte streams, by ``workers`` background threads: a reader or writer hands
    it each tensor's bytes and goes on.  A stream's chunks are hashed in the order added, by one
    thread; different streams go to the threads in turn, so that on many cores the hashing keeps
    up with the fuse (one SHA-256 runs at about 2 GB/s).  Copied bytes can arrive faster than
    that: past ``backlog`` bytes waiting, add() waits, so the chunks held stay bounded."""

    def __init__(self, workers=1, backlog=32 << 20):
        self._backlog, self._queued = backlog, 0
        self._queues = [collections.deque() for _ in range(max(1, workers))]
        self._files = collections.deque()  # add_file's streams, taken by any thread
        self._taken_files = 0
        self._assigned = {}   # an open stream -> its thread
        self._turn = 0
        self._open = {}
        self.digests = {}
        self._error = None
        self._closing = False
        self._cancelled = False
        self._cv = threading.Condition()
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True,
                                          name="ltx2blas-digests") for q in self._queues]
        for t in self._threads:
            t.start()

    def add_file(self, name, f, info):
        """The stream ``name``: tensor ``info``'s bytes in SafetensorsFile ``f``, read by a
        hashing thread (from the page cache, where the caller has just read them): the caller
        need not hold them until they are hashed.  Hashed when no thread has bytes waiting
        that a caller holds (a writer's buffers come back sooner)."""
        with self._cv:
            self._files.append((name, _FileRange(f, info), True, None))
            self._cv.notify_all()

    def hash_now(self, name, data):
        """The stream ``name`` whole, hashed on the caller's thread: for bytes the caller may
        change once this returns."""
        self.digests[name] = sha256_of(data)

    def add(self, name, data, last=True, on_done=None):
        """Append ``data`` (not to change until ``on_done()`` is called, from a hashing thread)
        to the stream ``name``; ``last`` ends the stream."""
        size = _size(data)
        with self._cv:
            while (self._queued and self._queued + size > self._backlog
                   and self._error is None):
                self._cv.wait()
            queue = self._assigned.pop(name, None)
            if queue is None:
                queue = self._queues[self._turn]
                self._turn = (self._turn + 1) % len(self._queues)
            if not last:
                self._assigned[name] = queue
            queue.append((name, data, last, on_done))
            self._queued += size
            self._cv.notify_all()

    def _run(self, queue):
        buffer = None
        while True:
            with self._cv:
                while not queue and not self._files and not self._closing:
                    self._cv.wait()
                if self._cancelled or (not queue and not self._files):
                    return
                source = queue if queue else self._files
                if source is queue:
                    name, data, last, on_done = queue[0]
                else:  # taken off the shared list now; counted until hashed
                    name, data, last, on_done = source.popleft()
                    self._taken_files += 1
            try:
                if isinstance(data, _FileRange):
                    buffer = np.empty(1 << 20, np.uint8) if buffer is None else buffer
                    self.digests[name] = tensor_digest(data.f, data.info, buffer)
                    continue
                h = self._open.setdefault(name, hashlib.sha256())
                h.update(memoryview(data).cast("B"))
                if last:
                    self.digests[name] = self._open.pop(name).hexdigest()
            except BaseException as exc:  # reported by wait()
                self._error = exc
            finally:
                if on_done is not None:
                    on_done()
                with self._cv:
                    if source is queue and queue:  # a cancel may have emptied it
                        queue.popleft()
                    self._queued -= _size(data)
                    self._taken_files -= source is self._files
                    self._cv.notify_all()

    def wait(self):
        """Every digest of the streams ended so far, once each of their chunks is hashed."""
        with self._cv:
            while any(self._queues) or self._files or self._taken_files:
                self._cv.wait()
        if self._error is not None:
            raise self._error
        return self.digests

    def close(self, cancel=False):
        """Hash what is queued, then end the threads.  ``cancel`` (on the way out of an error or
        a stop): drop what is queued and wait for no thread, since one may wait for ever on
        the lock an interrupted main thread left held (they are daemons)."""
        with self._cv:
            self._closing = True
            if cancel:
                self._cancelled = True
                for q in self._queues:
                    q.clear()
                self._files.clear()
            self._cv.notify_all()
        if not cancel:
            for t in self._threads:
                t.join()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(cancel=exc_type is not None)


class _FileRange:
    def __init__(self, f, info):
        self.f, self.info = f, info


def _size(data):
    return 0 if isinstance(data, _FileRange) else memoryview(data).nbytes


def _hash_range(f, start, end, buffer, *hashes):
    """Feed bytes [start, end) of SafetensorsFile ``f`` to each of ``hashes``, read through
    ``buffer`` (a uint8 array, reused): pread, not a memory map (a file cut short under a
    mapping kills the process)."""
    offset = start
    while offset < end:
        part = buffer[:min(buffer.size, end - offset)]
        read_into(f.fileno(), part, offset, f.path)
        for h in hashes:
            h.update(part)
        offset += part.size


def file_digests(f, chunk=1 << 20, tensors=True):
    """(SHA-256 of the whole file, {tensor: SHA-256 of its bytes}; {} with ``tensors`` False)
    of a SafetensorsFile, in one pass: its tensors tile the data after the header with no gap
    or trailing byte (the reader refuses any), so the file is the header followed by each
    tensor in the order of its offset."""
    whole = hashlib.sha256()
    buffer = np.empty(chunk, np.uint8)
    _hash_range(f, 0, f.data_start, buffer, whole)
    parts = {}
    for name, info in sorted(f.tensors.items(), key=lambda item: item[1].begin):
        if tensors:
            parts[name] = hashlib.sha256()
        _hash_range(f, info.begin, info.begin + info.nbytes, buffer, whole, *(
            [parts[name]] if tensors else []))
    return whole.hexdigest(), {name: h.hexdigest() for name, h in parts.items()}


def tensor_digest(f, info, buffer):
    """The SHA-256 of one tensor's bytes in file ``f``, read through ``buffer`` (uint8)."""
    h = hashlib.sha256()
    _hash_range(f, info.begin, info.begin + info.nbytes, buffer, h)
    return h.hexdigest()


def make_record(version, options, base_name, base_read, adapters, output):
    """The record a fuse writes (every digest may still be PLACEHOLDER):

    ``options``: the OPTIONS as the fuse ran; ``base_read``: {tensor: digest} of the base's
    tensors the fuse computed from (its fused weights, their scales, its biases), each changed
    in the output; every other tensor is copied, so its base digest is its output digest;
    ``adapters``: [(file name, file digest, strength, {tensor: digest})] in the order they were
    applied; ``output``: {tensor: digest} of every tensor written."""
    return {
        "format": RECORD_FORMAT, "contract": CONTRACT, "ltx2blas": version,
        "options": dict(options),
        "base": {"file": base_name, "read": base_read},
        "adapters": [{"file": name, "sha256": digest, "strength": strength, "tensors": tensors}
                     for name, digest, strength, tensors in adapters],
        "output": output,
    }


#: The deepest nesting of the JSON in a metadata entry that is read (a record nests 4 deep, a
#: history of fuses 3): whatever reads or writes such a value again walks it by recursion.
MAX_DEPTH = 32


class MetadataJSONError(ValueError):
    """A metadata entry's JSON that is not read: args[0] says why."""


def load_json(text, what):
    """The value of the JSON text ``text`` of a metadata entry (``what`` names it), read as
    strictly and within the same bounds as a header (no duplicate key, NaN or Infinity, at
    most MAX_JSON_SEPARATORS separators) and at most MAX_DEPTH levels deep; else
    MetadataJSONError, never RecursionError (the metadata is the file's to choose)."""
    def fail(message):
        raise MetadataJSONError(message)

    if not isinstance(text, str):
        fail(f"{what} is not a string")
    value = parse_json(text, fail, what)
    # the nesting, counted without recursion: a value parsed just under Python's limit would
    # overflow it later, in whatever walks or writes it again
    level, depth = [value], 1
    while level:
        if depth > MAX_DEPTH:
            fail(f"{what} nests JSON more than {MAX_DEPTH} deep")
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)
                 if isinstance(v, (dict, list))]
        depth += 1
    return value


def read_record(metadata):
    """(record or None, why there is none: "missing" or "unreadable"): the record of a fused
    file's metadata, every field a verification reads checked for its type and, for the
    options and strengths, its values (the metadata is the file's to choose)."""
    text = metadata.get(RECORD_KEY)
    if text is None:
        return None, "missing"
    try:
        record = load_json(text, "the entry")
    except MetadataJSONError:
        return None, "unreadable"
    return (record, "") if _well_formed(record) else (None, "unreadable")


def _digests(value):
    return isinstance(value, dict) and all(isinstance(d, str) for d in value.values())


def _well_formed(record):
    def number(v):
        # a strength is fused as f32: one that is not finite there (1e39, a 401-digit
        # integer) is the record's fault, not the adapter's
        try:
            strength_f32(v, "strength")
        except Ltx2BlasError:
            return False
        return True

    def version(v):  # printed in the summary: a small positive int
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31

    try:
        options = record["options"]
        return (version(record["format"]) and version(record["contract"])
                and isinstance(record.get("ltx2blas", ""), str)
                and options.get("rule") in RULES and options.get("alpha") in ALPHA_MODES
                and isinstance(options.get("allow_unmatched"), bool)
                and options.get("fp8_rounding") in FP8_ROUNDINGS
                and isinstance(options.get("seed"), int)
                and not isinstance(options.get("seed"), bool)
                and options.get("fp8_overflow") in FP8_OVERFLOWS
                and _digests(record["output"]) and _digests(record["base"]["read"])
                and isinstance(record["adapters"], list)
                and all(_digests(a["tensors"]) and isinstance(a["sha256"], str)
                        and number(a["strength"]) and isinstance(a.get("file", ""), str)
                        for a in record["adapters"]))
    except (KeyError, TypeError, AttributeError):
        return False
