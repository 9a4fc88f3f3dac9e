"""The safetensors reader under a mutational fuzzer, a fixed number of cases (tests/fuzz/): every
input is read or refused with FormatError / Ltx2IOError, never another exception."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import fuzz_safetensors  # noqa: E402


def test_seed_corpus_reads():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        assert all(fuzz_safetensors.check_one(data, folder) == "ok"
                   for data in fuzz_safetensors.corpus())


def test_mutated_inputs_are_read_or_refused_cleanly():
    # A number of cases, not a time: every machine, under any load, runs the same inputs
    outcomes = fuzz_safetensors.mutate_for(seconds=float("inf"), seed=1234, max_cases=20_000)
    assert set(outcomes) <= {"ok", "FormatError", "Ltx2IOError"}
    assert sum(outcomes.values()) == 20_000 and outcomes.get("FormatError", 0) > 50
