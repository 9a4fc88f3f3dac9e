"""A fused checkpoint's provenance: what rebuilding it takes, and the digests that name its
inputs and its tensors (docs/verify.md): SHA-256 of each adapter file whole (the value Hugging
Face shows), BLAKE3 of each tensor (format 2; format 1, 0.1.0's, holds SHA-256 of each tensor
and is still read).

A fuse's bytes depend only on its inputs, its options and the arithmetic contract, never on the
machine, the thread count or the tile; so the record below suffices for anyone holding the same
base and adapter files to rebuild the output byte for byte, and to check a file against it.
"""
import base64
import collections
import hashlib
import struct
import threading

import blake3
import numpy as np

from .._validate import FP8_OVERFLOWS, FP8_ROUNDINGS, RULES, strength_f32
from ..errors import Ltx2BlasError
from ..quantized import QUANTIZE_FORMATS
from .adapters import ALPHA_MODES
from .safetensors import parse_json, read_into

#: The version of the arithmetic contract (docs/arithmetic.md).  It changes whenever a rule
#: there changes the bytes of some fuse; files fused under another version are not compared.
CONTRACT = 1
#: The version of the record's own layout that a fuse writes; every format up to it is read.
RECORD_FORMAT = 2
RECORD_KEY = "ltx2blas.provenance"
#: The hash of each tensor's bytes in a format 2 record (format 1's is SHA-256).
TENSOR_HASH = "blake3"
HASHES = {"sha256": hashlib.sha256, "blake3": blake3.blake3}
#: The placeholder of a digest not yet known when the header is written first: the same
#: length, so the finished header replaces it in place.
PLACEHOLDER = "0" * 64
#: A format 2 record's size: at most this many bytes per output tensor (its digest, one bit
#: saying whether the fuse computed it from the base's tensor) and per adapter tensor (its
#: digest), plus RECORD_FIXED and each adapter's RECORD_PER_ADAPTER and file name
#: (JSON-escaped: at most 6 bytes a character).
RECORD_PER_OUTPUT_TENSOR = 44
RECORD_PER_ADAPTER_TENSOR = 43
RECORD_FIXED = 1024
RECORD_PER_ADAPTER = 256
#: The options that decide a fuse's bytes, as the record names them.
OPTIONS = ("rule", "alpha", "allow_unmatched", "fp8_rounding", "seed", "fp8_overflow")


def sha256_of(data):
    """The hex SHA-256 of a bytes-like object or a C-contiguous array (hashlib releases the GIL
    on large buffers, so this runs beside other threads)."""
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def digest_of(data, hash_name=TENSOR_HASH):
    """The hex digest by ``hash_name`` ("blake3", "sha256") of a bytes-like object or a
    C-contiguous array (both release the GIL on large buffers)."""
    return HASHES[hash_name](memoryview(data).cast("B")).hexdigest()


def tensor_hash_of(record):
    """The hash of a record's tensor digests: SHA-256 in format 1, else the record's "hash"."""
    return "sha256" if record["format"] == 1 else record["hash"]


class Hasher:
    """Digests (``hash_name``: BLAKE3 by default) of named byte streams, by ``workers`` background threads: a reader or writer hands
    it each tensor's bytes and goes on.  A stream's chunks are hashed in the order added, by one
    thread; different streams go to the threads in turn, so that on many cores the hashing keeps
    up with the fuse (one SHA-256 runs at about 2 GB/s, one BLAKE3 at 3-6).  Copied bytes can
    arrive faster than that: past ``backlog`` bytes waiting, add() waits, so the chunks held
    stay bounded."""

    def __init__(self, workers=1, backlog=32 << 20, hash_name=TENSOR_HASH):
        self.hash_name = hash_name
        self._new = HASHES[hash_name]
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
        self.digests[name] = digest_of(data, self.hash_name)

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
                    self.digests[name] = tensor_digest(data.f, data.info, buffer,
                                                       self.hash_name)
                    continue
                h = self._open.get(name)
                if h is None:
                    h = self._open[name] = self._new()
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


def file_digests(f, chunk=1 << 20, tensors=True, hash_name=TENSOR_HASH):
    """(SHA-256 of the whole file, {tensor: digest of its bytes by ``hash_name``}; {} with
    ``tensors`` False) of a SafetensorsFile, in one pass: its tensors tile the data after the
    header with no gap or trailing byte (the reader refuses any), so the file is the header
    followed by each tensor in the order of its offset."""
    whole = hashlib.sha256()
    buffer = np.empty(chunk, np.uint8)
    _hash_range(f, 0, f.data_start, buffer, whole)
    parts = {}
    for name, info in sorted(f.tensors.items(), key=lambda item: item[1].begin):
        if tensors:
            parts[name] = HASHES[hash_name]()
        _hash_range(f, info.begin, info.begin + info.nbytes, buffer, whole, *(
            [parts[name]] if tensors else []))
    return whole.hexdigest(), {name: h.hexdigest() for name, h in parts.items()}


def tensor_digest(f, info, buffer, hash_name=TENSOR_HASH):
    """The digest by ``hash_name`` of one tensor's bytes in file ``f``, read through
    ``buffer`` (uint8)."""
    h = HASHES[hash_name]()
    _hash_range(f, info.begin, info.begin + info.nbytes, buffer, h)
    return h.hexdigest()


def names_digest(names):
    """The BLAKE3 (base64) of a list of tensor names in its order, each as its length (8 bytes,
    little-endian) and its UTF-8 bytes: what a format 2 record's digest lists are in the
    order of."""
    h = blake3.blake3()
    for name in names:
        data = name.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return base64.b64encode(h.digest()).decode()


def pack(digests):
    """Hex digests of 32 bytes, in order, as one base64 string (43 bytes a digest at most)."""
    return base64.b64encode(b"".join(bytes.fromhex(d) for d in digests)).decode()


def unpack(text, count):
    """The ``count`` hex digests of ``pack``'s string ``text``, or None where it holds
    another number (or is not base64)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return None
    if len(raw) != 32 * count:
        return None
    return [raw[i:i + 32].hex() for i in range(0, len(raw), 32)]


def digest_list(digests):
    """{tensor: hex digest} as a format 2 list: the count, the names' digest (names_digest)
    and the digests packed, all in the order of the names sorted (by code point)."""
    names = sorted(digests)
    return {"count": len(names), "names": names_digest(names),
            "digests": pack(digests[n] for n in names)}


def expand(listed, names):
    """{tensor: hex digest} of a format 2 digest list, given the tensor names it was made of
    (a file's); None where they are not those names."""
    names = sorted(names)
    if listed["count"] != len(names) or listed["names"] != names_digest(names):
        return None
    digests = unpack(listed["digests"], len(names))
    return None if digests is None else dict(zip(names, digests))


def make_record(version, options, base_name, computed, adapters, output, quantize=None):
    """The record a fuse writes, of format 2 (every digest may still be PLACEHOLDER):

    ``options``: the OPTIONS as the fuse ran; ``computed``: the names of the base's tensors
    the fuse computed from (its fused weights, their scales, its biases), each changed in the
    output; every other tensor is copied, so its base digest is its output digest;
    ``adapters``: [(file name, file SHA-256, strength, {tensor: digest})] in the order they
    were applied; ``output``: {tensor: digest} of every tensor written.

    No tensor name is stored (the file's header holds the output's, an adapter file its
    own): each digest list is in the order of the sorted names, with their count and a
    digest of the names; the tensors computed are one bit each in the output's order.  No
    digest of a computed tensor's base bytes is kept: it would hash each fused byte a second
    time, and a rebuild from the inputs checks those bytes (docs/verify.md).  Its size is
    bounded by RECORD_PER_OUTPUT_TENSOR, RECORD_PER_ADAPTER_TENSOR, RECORD_FIXED and
    RECORD_PER_ADAPTER.  ``quantize``: how the output's weights were quantised after the
    fuse (``ltx2blas quantize`` or ``fuse --to``: QUANTIZE_KEYS), or None."""
    names = sorted(output)
    bits = bytearray((len(names) + 7) // 8)
    for i, name in enumerate(names):
        if name in computed:
            bits[i // 8] |= 1 << (i % 8)
    return {
        "format": RECORD_FORMAT, "contract": CONTRACT, "ltx2blas": version,
        "options": dict(options), "hash": TENSOR_HASH,
        "base": {"file": base_name, "read": base64.b64encode(bytes(bits)).decode()},
        "adapters": [{"file": name, "sha256": digest, "strength": strength,
                      "tensors": digest_list(tensors)}
                     for name, digest, strength, tensors in adapters],
        "output": digest_list(output),
        **({"quantize": dict(quantize)} if quantize is not None else {}),
    }


#: A record's "quantize": the format, comfy_fp8's codes, comfy_int8's scales per row, and the
#: globs that changed the owner's choice of layers (docs/quantize.md).
QUANTIZE_KEYS = ("format", "fp8_format", "per_row", "include", "exclude")


def _quantize_field(value):
    if value is None:
        return True
    return (isinstance(value, dict) and set(value) == set(QUANTIZE_KEYS)
            and value["format"] in QUANTIZE_FORMATS
            and value["fp8_format"] in (None, "F8_E4M3", "F8_E5M2")
            and isinstance(value["per_row"], bool)
            and all(isinstance(g, list) and all(isinstance(x, str) for x in g)
                    for g in (value["include"], value["exclude"])))


def expand_output(record, names):
    """(output digests, base tensors computed from) of record, given the file's tensor names:
    {tensor: hex digest}, and {tensor: the hex digest of its base bytes, or None where the
    record keeps none (format 2)}; (None, None) where the names are not those the record was
    made of."""
    if record["format"] == 1:
        return record["output"], record["base"]["read"]
    output = expand(record["output"], names)
    if output is None:
        return None, None
    try:
        bits = base64.b64decode(record["base"]["read"].encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return None, None
    ordered = sorted(output)
    if len(bits) != (len(ordered) + 7) // 8:
        return None, None
    return output, {n: None for i, n in enumerate(ordered) if bits[i // 8] >> (i % 8) & 1}


def adapter_tensors(recorded, names):
    """{tensor: hex digest} of one of a record's adapters, given the tensor names of the file
    compared (format 2 lists no names); None where they are not those recorded."""
    tensors = recorded["tensors"]
    return expand(tensors, names) if "digests" in tensors and "count" in tensors else tensors


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


def _digest_list(value):
    count = value.get("count") if isinstance(value, dict) else None
    # a count is printed and multiplied by 32: a small non-negative int
    return (isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 2**40
            and isinstance(value.get("names"), str) and isinstance(value.get("digests"), str))


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
        if version(record["format"]) and record["format"] > RECORD_FORMAT:
            # a newer layout: only what says so is read
            return (version(record["contract"]) and isinstance(record.get("ltx2blas", ""), str)
                    and isinstance(record["adapters"], list))
        options = record["options"]
        return (version(record["format"]) and version(record["contract"])
                and isinstance(record.get("ltx2blas", ""), str)
                and options.get("rule") in RULES and options.get("alpha") in ALPHA_MODES
                and isinstance(options.get("allow_unmatched"), bool)
                and options.get("fp8_rounding") in FP8_ROUNDINGS
                and isinstance(options.get("seed"), int)
                and not isinstance(options.get("seed"), bool)
                and options.get("fp8_overflow") in FP8_OVERFLOWS
                and (record["format"] == 1 and _digests(record["output"])
                     and _digests(record["base"]["read"])
                     or record["format"] != 1 and record.get("hash") in HASHES
                     and _digest_list(record["output"])
                     and isinstance(record["base"]["read"], str))
                and isinstance(record["adapters"], list)
                and _quantize_field(record.get("quantize"))
                and all((_digests if record["format"] == 1 else _digest_list)(a["tensors"])
                        and isinstance(a["sha256"], str)
                        and number(a["strength"]) and isinstance(a.get("file", ""), str)
                        for a in record["adapters"]))
    except (KeyError, TypeError, AttributeError):
        return False
