"""README.md's examples run as written: each Python block, and each block of ltx2blas commands,
on its own in an empty folder that holds small stand-ins for the files it names, so that the
guide cannot drift from the code."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import ckpt_helpers as ck

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "README.md")


def blocks(language):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def command_blocks():
    """The sh blocks whose every command is an ltx2blas command, continuation lines joined."""
    out = []
    for block in blocks("sh"):
        commands = [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
        if commands and all(c.startswith("ltx2blas") for c in commands):
            out.append(commands)
    return out


def stand_ins(folder, rng):
    """The files the examples name: an LTX-2-shaped checkpoint and two adapters for it."""
    ck.write(folder / "ltx-2-19b-dev.safetensors", ck.model(rng))
    modules = list(ck.MODULES)
    ck.write(folder / "distilled-lora-384.safetensors", ck.adapter(rng, modules, rank=8))
    ck.write(folder / "style.safetensors", ck.adapter(rng, modules[:2], rank=4, prefix="",
                                                      style="kohya", alpha=2.0))


def test_the_readme_has_the_examples_this_test_runs():
    assert len(blocks("python")) == 2 and len(command_blocks()) == 6


def test_the_readme_is_a_guide_of_at_most_250_lines():
    """Details live in docs/; the README stays a guide that can be read through."""
    with open(README, encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 250


def test_the_readme_shows_the_command_line_before_the_python_api():
    with open(README, encoding="utf-8") as f:
        headings = [line for line in f.read().splitlines() if line.startswith("## ")]
    assert headings.index("## The command line") < headings.index("## The Python API")
    assert headings[:2] == ["## Install", "## The command line"]


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_example_runs_on_its_own(tmp_path, rng, index):
    stand_ins(tmp_path, rng)
    script = tmp_path / "example.py"
    script.write_text(blocks("python")[index], encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr


def test_command_line_examples_run(tmp_path, rng):
    """Every block of commands, in the README's order (verify and extract read what fuse wrote)."""
    stand_ins(tmp_path, rng)
    for command in [c for block in command_blocks() for c in block]:
        args = command.split()[1:]
        r = subprocess.run([sys.executable, "-m", "ltx2blas", *args], capture_output=True,
                           text=True, cwd=tmp_path, timeout=600)
        assert r.returncode == 0, (command, r.stderr)
    assert (tmp_path / "ltx-2-19b-fused.safetensors").exists()
    assert not any(".ltx2blas-tmp-" in p.name for p in tmp_path.iterdir())


def test_the_examples_fuse_what_they_say(tmp_path, rng):
    """The checkpoint example's state-dict fuse gives the file fuse's bytes for the weights the
    adapter touches."""
    stand_ins(tmp_path, rng)
    import ltx2blas
    from ltx2blas.files.safetensors import SafetensorsFile

    model, style = tmp_path / "ltx-2-19b-dev.safetensors", tmp_path / "style.safetensors"
    ltx2blas.fuse_checkpoint(model, [(style, 0.8)], tmp_path / "out.safetensors")
    with SafetensorsFile(model) as f:
        state = {n: f.read(n) for n in f.tensors}
    ltx2blas.fuse_state_dict(state, [(str(style), 0.8)])
    with SafetensorsFile(tmp_path / "out.safetensors") as f:
        assert all(np.array_equal(f.read(n), state[n]) for n in f.tensors)


def test_the_adapter_key_spellings_shown_are_recognised(tmp_path, rng):
    """Each key the README shows for one weight, with its partner, fuses into that weight."""
    import ltx2blas

    (table,) = blocks("text")
    keys = [line.split()[0] for line in table.splitlines() if line.strip()]
    assert len(keys) >= 5
    ck.write(tmp_path / "model.safetensors", ck.model(rng))
    weight = "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"
    out_f, in_f = ck.MODULES["transformer_blocks.0.attn1.to_q"]
    for key in keys:
        partner = key.replace("lora_A", "lora_B").replace("lora_down", "lora_up")
        assert partner != key, key
        ck.write(tmp_path / "adapter.safetensors", {
            key: ("BF16", ck.random_bf16(rng, (4, in_f), 0.05)),
            partner: ("BF16", ck.random_bf16(rng, (out_f, 4), 0.05))})
        report = ltx2blas.fuse_checkpoint(tmp_path / "model.safetensors",
                                          [(tmp_path / "adapter.safetensors", 1.0)], None,
                                          dry_run=True)
        assert report.fused == [(weight, [0])], key


def test_the_shadowing_note_quotes_the_import_error():
    """The README quotes the error that Python run from the clone's root meets; the quote's
    pieces are in the message ltx2blas/__init__.py raises."""
    with open(README, encoding="utf-8") as f:
        text = " ".join(f.read().split())
    quote = re.search(r'import ltx2blas` stops with "(.*?)"', text).group(1)
    init = os.path.join(os.path.dirname(README), "ltx2blas", "__init__.py")
    with open(init, encoding="utf-8") as f:
        source = f.read()
    raised = re.search(r"raise ImportError\((.*?)name=__name__", source, flags=re.S).group(1)
    message = "".join(re.findall(r'f?"([^"]*)"', raised)).replace("{__path__[0]}",
                                                                   "/clone/ltx2blas")
    pieces = [p.strip() for p in quote.split("…") if p.strip()]
    assert len(pieces) >= 3 and all(p in message for p in pieces), (pieces, message)
    assert "python -P" in text and "PYTHONSAFEPATH=1" in text
