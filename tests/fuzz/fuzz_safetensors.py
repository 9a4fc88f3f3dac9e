"""Fuzzing the safetensors reader: whatever the bytes, SafetensorsFile either reads the file or
raises FormatError / Ltx2IOError -- never another exception, never a crash, and within bounded
time and memory.

Two drivers share ``check_one``:
  * ``mutate_for(seconds, seed)``: a small mutational fuzzer over the seed files in corpus/
    (bit flips, byte insertions and deletions, header-length rewrites, JSON-aware edits); the
    test suite runs it for a bounded time.
  * with atheris installed: ``python tests/fuzz/fuzz_safetensors.py [atheris args]`` runs
    coverage-guided fuzzing from the same corpus, for as long as you like.
"""
import json
import os
import random
import struct
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def check_one(data, folder):
    """Write ``data`` to a file and open it; return "ok", or the error's class name; re-raise
    anything that is not a FormatError / Ltx2IOError."""
    from ltx2blas.errors import FormatError, Ltx2IOError
    from ltx2blas.files.safetensors import SafetensorsFile

    path = os.path.join(folder, "case.safetensors")
    with open(path, "wb") as f:
        f.write(data)
    try:
        with SafetensorsFile(path) as st:
            for name in list(st.tensors)[:4]:
                if st.tensors[name].nbytes <= 1 << 20:
                    st.read(name)
        return "ok"
    except (FormatError, Ltx2IOError) as exc:
        return type(exc).__name__


def corpus():
    files = sorted(os.listdir(CORPUS))
    return [open(os.path.join(CORPUS, f), "rb").read() for f in files]


def _mutate(data, rng):
    data = bytearray(data)
    kind = rng.randrange(7)
    if kind == 0 and data:  # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # insert bytes
        i = rng.randrange(len(data) + 1)
        data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 2 and data:  # delete a run
        i = rng.randrange(len(data))
        del data[i:i + rng.randint(1, 64)]
    elif kind == 3 and len(data) >= 8:  # rewrite the header length
        n = rng.choice([0, 1, 7, 2**63, 2**64 - 1, 100_000_001, len(data), len(data) - 8,
                        struct.unpack("<Q", bytes(data[:8]))[0] + rng.randint(-9, 9)])
        data[:8] = struct.pack("<Q", n % 2**64)
    elif kind == 4 and len(data) > 8:  # edit a JSON value in the header
        n = struct.unpack("<Q", bytes(data[:8]))[0]
        try:
            header = json.loads(bytes(data[8:8 + n]))
        except Exception:
            return bytes(data)
        if isinstance(header, dict) and header:
            key = rng.choice(list(header))
            entry = header[key]
            choices = [-1, 1.5, True, None, "2", 2**64, [], [1, 2, 3], {"x": 1}, 10**30]
            if isinstance(entry, dict) and entry:
                field = rng.choice(list(entry))
                entry[field] = rng.choice(choices + ([[0, 1]] if field == "shape" else []))
            else:
                header[key] = rng.choice(choices)
            if rng.random() < 0.2:
                header["__metadata__"] = rng.choice([{"a": 1}, "x", [1], {"dtype": "F32"}])
            body = json.dumps(header).encode()
            data = bytearray(struct.pack("<Q", len(body)) + body + bytes(data[8 + n:]))
    elif kind == 5:  # deep nesting or many entries
        body = rng.choice([b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000])
        data = bytearray(struct.pack("<Q", len(body)) + body)
    elif kind == 6 and data:  # truncate
        del data[rng.randrange(len(data)):]
    return bytes(data)


def mutate_for(seconds, seed=0, max_cases=None):
    """Run mutated corpus files for up to ``seconds``; return {outcome: count}."""
    rng = random.Random(seed)
    seeds = corpus()
    outcomes = {}
    end = time.monotonic() + seconds
    cases = 0
    with tempfile.TemporaryDirectory() as folder:
        while time.monotonic() < end and (max_cases is None or cases < max_cases):
            data = rng.choice(seeds)
            for _ in range(rng.randint(1, 3)):
                data = _mutate(data, rng)
            outcome = check_one(data, folder)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            cases += 1
    return outcomes


def main():  # pragma: no cover - the atheris entry point
    import atheris

    folder = tempfile.mkdtemp()

    def one(data):
        check_one(bytes(data), folder)

    atheris.Setup(sys.argv + [CORPUS], one)
    atheris.Fuzz()


if __name__ == "__main__":  # pragma: no cover
    main()
