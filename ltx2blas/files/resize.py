"""A LoRA file re-factored at a smaller rank (``ltx2blas resize``).

Every LoRA module of the file (a lora_A / lora_B pair in any spelling the fuse reads: upstream
LTX-2's trainer, PEFT and diffusers, kohya, ComfyUI) is re-factored by
:func:`ltx2blas.resize.resize_lora_weight`: its delta's scale (alpha / rank, or PEFT's from the
file's metadata; none under ``alpha="ignore"``, as upstream LTX-2 reads its files) is folded
into the new factors, and each pair gets an ``.alpha`` equal to its new rank, so that every
loader, those that read alpha and those that do not, applies the same delta.  Keys keep the
input's spelling and order; tensors of no LoRA pair (biases of the up projection, unknown keys)
are copied as they are.  Modules that are no sum of a low-rank product -- DoRA, LoHa, LoKr, full
differences -- are refused with the reason before anything is written.
"""
import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import ArgumentError, DTypeError, FormatError, ShapeError, counted, printable
from ..resize import RANK_RULES, rank_rule, resize_lora_weight
from .._validate import bf16_to_f32, choice
from . import keys as keymatch
from . import peft
from .adapters import (ALPHA_MODES, AdapterReport, Source, _lycoris_dim, _lycoris_scale,
                       _scale_rule)
from .checkpoint import Progress, check_output_is_not_an_input
from .safetensors import SafetensorsWriter, output_path

METADATA_KEY = "ltx2blas.resized"
#: kohya's metadata entries of the network's rank and alpha, rewritten to the new largest rank
#: (alpha = rank: a scale of 1, as the pairs' own alphas).
KOHYA_DIM, KOHYA_ALPHA = "ss_network_dim", "ss_network_alpha"
#: What each role that resize cannot re-factor belongs to.
NOT_A_PRODUCT = {"magnitude": "DoRA (its magnitudes rescale the whole weight: not a sum of "
                              "deltas)",
                 "dora_scale": "DoRA (its magnitudes rescale the whole weight: not a sum of "
                               "deltas)",
                 "diff": "a full difference (no low-rank product to re-factor)",
                 "diff_b": "a full difference (no low-rank product to re-factor)"}


@dataclass
class ResizeReport:
    output: str
    rule: str                     # one of resize.RANK_RULES
    value: object                 # its rank or target
    max_rank: object = None
    alpha: str = "scale"
    alpha_source: str = ""        # where the scales folded in came from
    ranks: dict = field(default_factory=dict)   # module -> (old rank, new rank, fraction kept)
    copied: list = field(default_factory=list)  # tensors written as they were
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self):
        out = asdict(self)
        out["ranks"] = {m: {"rank_in": a, "rank": b, "kept": k}
                        for m, (a, b, k) in self.ranks.items()}
        return out

    def summary(self):
        old = [a for a, _, _ in self.ranks.values()]
        new = [b for _, b, _ in self.ranks.values()]
        kept = [k for _, _, k in self.ranks.values()]
        how = f"rank {self.value}" if self.rule == "rank" else f"{self.rule} {self.value:g}" + (
            f" (at most rank {self.max_rank})" if self.max_rank is not None else "")
        lines = [f"resized {counted(len(new), 'LoRA module')} by {how} into "
                 f"{printable(self.output)} ({self.bytes_written / 2**20:.1f} MiB, from "
                 f"{self.bytes_read / 2**20:.1f} MiB)"]
        if new:
            lines.append(f"ranks {min(old)}-{max(old)} -> {min(new)}-{max(new)} (median "
                         f"{int(np.median(new))}); fraction of each delta's Frobenius norm kept: "
                         f"least {min(kept):.4f}, median {float(np.median(kept)):.4f} (the "
                         "optimum at each rank)")
        lines.append("scale folded into the factors: " + (
            self.alpha_source or "none (no alpha)") + "; each pair's .alpha is its new rank"
            if self.alpha == "scale" else
            "scale folded into the factors: none (alpha='ignore', as upstream LTX-2 reads the "
            "file); each pair's .alpha is its new rank")
        if self.copied:
            shown = ", ".join(map(printable, self.copied[:3]))
            lines.append(f"{counted(len(self.copied), 'other tensor')} copied as they were "
                         f"({shown}{', ...' if len(self.copied) > 3 else ''})")
        lines.append(f"{self.seconds:.1f} s")
        return "\n".join(lines)


def _modules(source, products=False):
    """({module: {role: key}} of the LoRA pairs in file order, [keys copied as they are]);
    FormatError naming a module resize cannot re-factor.  ``products``: LoHa, LoKr and full
    difference modules are taken too (merge writes each as a product, _product_form)."""
    modules, copied = {}, []
    for key in source.keys:
        module, suffix = keymatch.split_key(key)
        if module is None:
            copied.append(key)
            continue
        if suffix in keymatch.REFUSED:
            raise FormatError(f"{source.name}: {key!r} belongs to {keymatch.REFUSED[suffix]} "
                              "adapter, which resize does not re-factor; nothing written")
        role = keymatch.ROLES[suffix]
        lycoris = role in keymatch.LOHA_ROLES + keymatch.LOKR_ROLES
        # merge takes LyCORIS modules and full differences, each as a product of its own
        taken = products and (lycoris or role == "diff")
        if (role in NOT_A_PRODUCT or lycoris) and not taken:
            kind = NOT_A_PRODUCT.get(role) or (
                "a LoHa (a Hadamard product of two low-rank products)" if role.startswith("hada")
                else "a LoKr (a Kronecker product)")
            raise FormatError(f"{source.name}: module {module!r} is {kind}: resize re-factors "
                              "LoRA pairs only; nothing written")
        if role == "up_bias":
            copied.append(key)
            continue
        pair = modules.setdefault(module, {})
        if role in pair:
            raise FormatError(f"{source.name}: module {module!r} has two {role} tensors "
                              f"({pair[role]!r}, {key!r})")
        pair[role] = key
    for module, pair in modules.items():
        missing = [r for r in ("down", "up") if r not in pair]
        if products and _kind(pair) != "lora":
            continue
        if missing:
            raise FormatError(f"{source.name}: module {module!r} has no "
                              f"{' or '.join('lora_A' if r == 'down' else 'lora_B' for r in missing)}"
                              " tensor")
    if not modules:
        raise FormatError(f"{source.name}: no LoRA pair (lora_A / lora_B, lora_down / lora_up) "
                          "to resize")
    return modules, copied


def _kind(roles):
    """A module's kind by its roles: lora, loha, lokr or diff (FormatError for a mixture)."""
    kinds = {"lora" if r in ("down", "up") else "loha" if r.startswith("hada") else
             "lokr" if r.startswith("lokr") else "diff" if r == "diff" else None
             for r in roles if r != "alpha"}
    kinds.discard(None)
    if len(kinds) != 1:
        raise FormatError(f"a module has tensors of {', '.join(sorted(kinds)) or 'no'} kind: "
                          f"{sorted(roles.values())}")
    return kinds.pop()


def _factor(source, key):
    dtype = source.dtype(key)
    if dtype not in ("BF16", "F16", "F32"):
        raise DTypeError(f"{source.name}: {key!r} is {dtype}; resize reads bf16, f16 and f32 "
                         "factors")
    return source.array(key)


def resize_lora(lora, output, *, rank=None, energy=None, sv_ratio=None, sv_fro=None,
                sv_cumulative=None, max_rank=None, alpha="scale", dtype=None, threads=None,
                progress=None):
    """Resize the LoRA file ``lora`` into ``output`` (see the module docstring).

    Parameters
    ----------
    rank, energy, sv_ratio, sv_fro, sv_cumulative : one of them
        As for :func:`ltx2blas.resize.resize_lora_weight`, for every module.
    max_rank : int, optional
        A cap on the per-module ranks of the dynamic rules.
    alpha : "scale" (default) or "ignore"
        Whether the file's alpha (its ``.alpha`` tensors or PEFT metadata) is part of the delta
        resized, as ComfyUI, diffusers and kohya read it, or not, as upstream LTX-2 does.
    dtype : "bf16", "f32" or None
        The new factors' storage; None: bf16 unless every factor is stored f32.
    threads : int or None
        As for resize_lora_weight (the same bytes for any count).
    progress : callable, optional
        Called with a :class:`~ltx2blas.files.checkpoint.Progress` after each module.

    Returns
    -------
    ResizeReport
    """
    rule, value = rank_rule(rank, energy, sv_ratio, sv_fro, sv_cumulative, max_rank)
    choice(alpha, ALPHA_MODES, "alpha")
    if dtype is not None:
        choice(dtype, ("bf16", "f32"), "dtype")
    output_path(output)  # a missing folder, a folder or a device: refused by name, first
    t0 = time.perf_counter()
    source = Source(lora)
    try:
        check_output_is_not_an_input(os.fspath(output), [source.name])
        return _resize(source, output, rule, value, max_rank, alpha, dtype, threads, progress,
                       t0)
    finally:
        source.close()


def _resize(source, output, rule, value, max_rank, alpha, dtype, threads, progress, t0):
    modules, copied = _modules(source)
    report = ResizeReport(output=os.fspath(output), rule=rule, value=value,
                          max_rank=max_rank if rule != "rank" else None, alpha=alpha,
                          copied=copied)
    if dtype is None:
        stored = {source.dtype(p[r]) for p in modules.values() for r in ("down", "up")}
        dtype = "f32" if stored == {"F32"} else "bf16"
    configs, _ = (peft.read_configs(source.metadata, source.name) if alpha == "scale"
                  else ({}, []))
    scales = AdapterReport(path=source.name, strength=1.0, alpha_mode=alpha)
    results = {}
    sizes = {m: sum(int(np.prod(source.shape(k))) for k in p.values()) for m, p in
             modules.items()}
    total = sum(sizes.values())
    done = 0
    for count, (module, roles) in enumerate(modules.items(), 1):
        a, b, scale = _lora_pair(source, module, roles, alpha, configs, scales, 1.0)
        try:
            new = resize_lora_weight(a, b, scale=scale, dtype=dtype, max_rank=max_rank,
                                     threads=threads, **{rule: value})
        except (ShapeError, ArgumentError) as exc:
            raise type(exc)(f"{printable(module)}: {exc}") from None
        results[module] = new
        report.ranks[module] = (int(a.shape[0]), new.rank, new.kept)
        done += sizes[module]
        if progress is not None:
            progress(Progress(count, len(modules), 0.0, 0.0, time.perf_counter() - t0, module,
                              done, total))
    report.alpha_source = scales.alpha_source
    entries, arrays = _layout(source, modules, results, dtype)
    metadata = {k: v for k, v in source.metadata.items() if k != peft.METADATA_KEY}
    largest = max(r.rank for r in results.values())
    for key in (KOHYA_DIM, KOHYA_ALPHA):
        if key in metadata:
            metadata[key] = str(largest)
    metadata[METADATA_KEY] = json.dumps({
        "rule": rule, "value": value, "max_rank": report.max_rank, "alpha": alpha,
        "dtype": dtype, "modules": {m: {"rank_in": a, "rank": b, "kept": round(k, 6)}
                                    for m, (a, b, k) in report.ranks.items()}},
        separators=(",", ":"))
    with SafetensorsWriter(output, entries, metadata) as writer:
        for name, dtype_name, shape, nbytes in entries:
            if name in arrays:
                writer.write(name, arrays[name])
            else:
                info = source.file.tensors[name]
                writer.copy(name, source.file.fileno(), info.begin, info.nbytes, source.name)
        writer.commit()
        report.bytes_written = writer.size
    report.bytes_read = source.file.size
    report.seconds = time.perf_counter() - t0
    return report


def _layout(source, modules, results, dtype):
    """The output's entries in the input's order (a pair's alpha after its lora_B where the
    input had none) and the arrays written for the pairs."""
    store = "BF16" if dtype == "bf16" else "F32"
    role_of = {key: (module, role) for module, roles in modules.items()
               for role, key in roles.items()}
    entries, arrays = [], {}

    def add(name, array, dtype_name):
        array = np.ascontiguousarray(array)
        entries.append((name, dtype_name, tuple(array.shape), array.nbytes))
        arrays[name] = array

    for key in source.keys:
        if key not in role_of:
            info = source.file.tensors[key]
            entries.append((key, info.dtype, tuple(info.shape), info.nbytes))
            continue
        module, role = role_of[key]
        new = results[module]
        if role == "down":
            add(key, new.lora_a, store)
        elif role == "up":
            add(key, new.lora_b, store)
            if "alpha" not in modules[module]:
                add(module + ".alpha", np.array(new.rank, np.float32), "F32")
        else:  # alpha
            add(key, np.array(new.rank, np.float32), "F32")
    return entries, arrays


__all__ = ["resize_lora", "ResizeReport", "RANK_RULES"]


# ---- merge ----

MERGE_METADATA_KEY = "ltx2blas.merged"
#: The output spellings (ltx2blas extract's): upstream LTX-2's trainer, diffusers', ComfyUI's.
MERGE_KEYS = ("ltx", "diffusers", "comfy")


@dataclass
class MergeReport:
    output: str
    inputs: list                  # [(path, strength)]
    rule: str
    value: object
    max_rank: object = None
    keys: str = "ltx"
    ranks: dict = field(default_factory=dict)   # module -> (sum of ranks, new rank, kept)
    exact: int = 0                # modules whose sum is kept whole (rank at least the sum)
    seconds: float = 0.0
    bytes_written: int = 0

    def as_dict(self):
        out = asdict(self)
        out["inputs"] = [{"path": p, "strength": s} for p, s in self.inputs]
        out["ranks"] = {m: {"sum_of_ranks": a, "rank": b, "kept": k}
                        for m, (a, b, k) in self.ranks.items()}
        return out

    def summary(self):
        new = [b for _, b, _ in self.ranks.values()]
        kept = [k for _, _, k in self.ranks.values()]
        how = f"rank {self.value}" if self.rule == "rank" else f"{self.rule} {self.value:g}"
        lines = [f"merged {counted(len(self.inputs), 'LoRA')} into {counted(len(new), 'module')} "
                 f"by {how} ({self.keys} keys) into {printable(self.output)} "
                 f"({self.bytes_written / 2**20:.1f} MiB)",
                 f"ranks {min(new)}-{max(new)}; {self.exact} of {len(new)} modules keep the sum "
                 f"whole (rank at least its inputs' ranks added); fraction of each summed delta's "
                 f"Frobenius norm kept: least {min(kept):.4f}, median "
                 f"{float(np.median(kept)):.4f} (the optimum at each rank)",
                 f"{self.seconds:.1f} s"]
        return "\n".join(lines)


def _ltx_module(module):
    """(an adapter module's LTX-2 module name, whether it is kohya's flattened spelling)."""
    name, prefix = keymatch.strip_prefix(module)
    if prefix in keymatch.FLAT_PREFIXES:
        return name, True
    if prefix == "transformer.":  # diffusers' names
        name = keymatch.to_ltx(name)
    return name, False


def _spelling(modules):
    """The extract spelling closest to a file's: comfy for lora_down / lora_up, diffusers for
    ``transformer.`` names, else upstream's trainer's."""
    roles = next(iter(modules.values()))
    if ".lora_down" in roles["down"] or "_lora.down" in roles["down"]:
        return "comfy"
    return "diffusers" if roles["down"].startswith("transformer.") else "ltx"


def merge_loras(inputs, output, *, rank=None, energy=None, sv_ratio=None, sv_fro=None,
                sv_cumulative=None, max_rank=None, keys=None, alpha="scale", dtype="bf16",
                threads=None, progress=None):
    """One LoRA whose every module is the best approximation, at the rank the rule gives, of
    ``sum_i strength_i * delta_i`` over the ``inputs`` [(path, strength)] that have it.

    LoRA pairs stack exactly: the factors, each input's scale and strength folded into its B,
    are concatenated (rank the sum of theirs) and re-factored as resize_lora_weight does, so a
    rank at least the sum keeps the sum whole, up to the factors' storage.  ``rank`` is each
    module's largest (a module whose inputs' ranks add up to less keeps that); the other rules
    as for resize.  Keys in ``keys`` (ltx2blas extract's spellings; default the first input's),
    each pair's .alpha its rank.  LoHa, LoKr and full-difference modules enter as exact
    products of their own (_product_form); DoRA and tensors of no adapter module are refused,
    naming them, before anything is written.
    """
    rule, value = rank_rule(rank, energy, sv_ratio, sv_fro, sv_cumulative, max_rank)
    choice(alpha, ALPHA_MODES, "alpha")
    choice(dtype, ("bf16", "f32"), "dtype")
    if keys is not None:
        choice(keys, MERGE_KEYS, "keys")
    inputs = [(os.fspath(p), float(s)) for p, s in inputs]
    if len(inputs) < 1:
        raise ArgumentError("merge needs at least one input LoRA")
    for path, strength in inputs:
        if not np.isfinite(strength):
            raise ArgumentError(f"{path}: strength {strength} is not finite")
    output_path(output)
    t0 = time.perf_counter()
    sources = []
    try:
        for path, _ in inputs:
            sources.append(Source(path))
        check_output_is_not_an_input(os.fspath(output), [s.name for s in sources])
        return _merge(sources, inputs, output, rule, value, max_rank, keys, alpha, dtype,
                      threads, progress, t0)
    finally:
        for source in sources:
            source.close()


def _merge(sources, inputs, output, rule, value, max_rank, keys, alpha, dtype, threads,
           progress, t0):
    from .extract import _names

    terms, order, flat = {}, [], {}
    first_modules = None
    for index, (source, (_, strength)) in enumerate(zip(sources, inputs)):
        modules, copied = _modules(source, products=True)
        if copied:
            shown = ", ".join(map(printable, copied[:3]))
            raise FormatError(f"{source.name}: {counted(len(copied), 'tensor')} of no adapter "
                              f"module ({shown}{', ...' if len(copied) > 3 else ''}): merge "
                              "takes LoRA, LoHa, LoKr and full-difference modules; nothing "
                              "written")
        if first_modules is None:
            first_modules = modules
        configs, _ = (peft.read_configs(source.metadata, source.name) if alpha == "scale"
                      else ({}, []))
        scales = AdapterReport(path=source.name, strength=strength, alpha_mode=alpha)
        for module, roles in modules.items():
            a, b, scale = _product_form(source, module, roles, alpha, configs, scales,
                                        strength)
            name, is_flat = _ltx_module(module)
            (flat if is_flat else terms).setdefault(name, []).append((index, module, a, b,
                                                                      scale))
            if not is_flat and name not in order:
                order.append(name)
    for name, entries in flat.items():  # kohya's flattened names, by the dotted ones given
        dotted = [m for m in order if m.replace(".", "_") == name]
        if not dotted:
            raise FormatError(f"{sources[entries[0][0]].name}: module {entries[0][1]!r} is in "
                              "kohya's flattened spelling, which names no module without the "
                              "model; merge it with an input that spells the same modules with "
                              "dots, or convert it first")
        terms[dotted[0]].extend(entries)
    keys = keys or _spelling(first_modules)
    report = MergeReport(output=os.fspath(output), inputs=inputs, rule=rule, value=value,
                         max_rank=max_rank if rule != "rank" else None, keys=keys)
    entries, arrays = [], {}
    store = "BF16" if dtype == "bf16" else "F32"
    for count, name in enumerate(order, 1):
        parts = terms[name]
        shapes = {(b.shape[0], a.shape[1]) for _, _, a, b, _ in parts}
        if len(shapes) != 1:
            listed = "; ".join(f"{sources[i].name}: [{b.shape[0]}, {a.shape[1]}]"
                               for i, _, a, b, _ in parts)
            raise ShapeError(f"module {printable(name)}: the inputs' deltas differ in shape "
                             f"({listed}); nothing written")
        a = np.concatenate([x for _, _, x, _, _ in parts], axis=0)  # f64 (_product_form)
        b = np.concatenate([y * s for _, _, _, y, s in parts], axis=1)
        bound = min(a.shape[0], b.shape[0], a.shape[1])
        rules = {rule: min(value, bound) if rule == "rank" else value}
        new = resize_lora_weight(a, b, dtype=dtype, max_rank=max_rank, threads=threads,
                                 **rules)
        report.ranks[name] = (int(a.shape[0]), new.rank, new.kept)
        report.exact += new.rank >= bound  # every singular value of the sum kept
        a_key, b_key, alpha_key = _names(name, keys)
        for key, array, dtype_name in ((a_key, new.lora_a, store), (b_key, new.lora_b, store),
                                       (alpha_key, np.array(new.rank, np.float32), "F32")):
            entries.append((key, dtype_name, tuple(array.shape), array.nbytes))
            arrays[key] = np.ascontiguousarray(array)
        if progress is not None:
            progress(Progress(count, len(order), 0.0, 0.0, time.perf_counter() - t0, name, 0,
                              0))
    metadata = {MERGE_METADATA_KEY: json.dumps({
        "inputs": [{"file": os.path.basename(p), "strength": s} for p, s in inputs],
        "rule": rule, "value": value, "max_rank": report.max_rank, "alpha": alpha,
        "dtype": dtype, "keys": keys,
        "modules": {m: {"sum_of_ranks": a, "rank": b, "kept": round(k, 6)}
                    for m, (a, b, k) in report.ranks.items()}}, separators=(",", ":"))}
    with SafetensorsWriter(output, entries, metadata) as writer:
        for name, *_ in entries:
            writer.write(name, arrays[name])
        writer.commit()
        report.bytes_written = writer.size
    report.seconds = time.perf_counter() - t0
    return report


def _product_form(source, module, roles, alpha, configs, report, strength):
    """(A [R, in], B [out, R], scale) with the module's delta = scale * B A exactly, in f64 but
    for the scale: a LoRA its own factors; a LoHa (P Q) . (R S) the row-wise Khatri-Rao
    products, B = [P_i (x) R_i], A^T = [Q^T_j (x) S^T_j], rank r1 r2; a LoKr kron(U1 V1, U2 V2)
    = kron(U1, U2) kron(V1, V2), each whole factor split as I W or W I, whichever is narrower
    (a factored one is its own pair); a full difference D = D I.  Scales as the fuse reads them
    (alpha / rank, or alpha / dim as ComfyUI takes a LyCORIS module's)."""
    kind = _kind(roles)
    if kind == "lora":
        a, b, scale = _lora_pair(source, module, roles, alpha, configs, report, strength)
        return _as_f64(a), _as_f64(b), scale
    value = {r: _as_f64(_factor(source, k)) for r, k in roles.items() if r != "alpha"}
    for role, array in value.items():
        if array.ndim != 2:
            raise ShapeError(f"{source.name}: {module}: {roles[role]!r} has shape "
                             f"{list(array.shape)}; merge takes 2-D factors")
    pair = keymatch.Pair(module, kind, dict(roles))
    if kind == "diff":
        d = value["diff"]
        return np.eye(d.shape[1]), d, strength
    if kind == "loha":
        p, q, r, s = (value[k] for k in keymatch.LOHA_ROLES)
        shape = (p.shape[0], q.shape[1])
        dim = _lycoris_dim(source, pair, shape, f"module {module} {list(shape)}")
        b = (p[:, :, None] * r[:, None, :]).reshape(p.shape[0], -1)
        a = (q.T[:, :, None] * s.T[:, None, :]).reshape(q.shape[1], -1).T
        return np.ascontiguousarray(a), b, _lycoris_scale(source, pair, dim, alpha, strength,
                                                          report)
    split = []
    for n in ("1", "2"):
        if f"lokr_w{n}" in value:
            w = value[f"lokr_w{n}"]
            split.append((np.eye(w.shape[0]), w) if w.shape[0] <= w.shape[1] else
                         (w, np.eye(w.shape[1])))
        else:
            split.append((value[f"lokr_w{n}_a"], value[f"lokr_w{n}_b"]))
    (u1, v1), (u2, v2) = split
    shape = (u1.shape[0] * u2.shape[0], v1.shape[1] * v2.shape[1])
    dim = _lycoris_dim(source, pair, shape, f"module {module} {list(shape)}")
    return np.kron(v1, v2), np.kron(u1, u2), _lycoris_scale(source, pair, dim, alpha, strength,
                                                            report)


def _lora_pair(source, module, roles, alpha, configs, report, strength):
    """(lora_A, lora_B as stored, the pair's scale at ``strength``, as the fuse reads it)."""
    a, b = _factor(source, roles["down"]), _factor(source, roles["up"])
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise ShapeError(f"{source.name}: {module}: lora_A {list(a.shape)} and lora_B "
                         f"{list(b.shape)} are not the factors of one product")
    pair = keymatch.Pair(module, "lora", dict(roles))
    return a, b, _scale_rule(configs, source, pair, a.shape[0], alpha, report)(strength)


def _as_f64(x):
    """A factor's values in f64 (bf16 bits widened exactly)."""
    return (bf16_to_f32(x) if x.dtype == np.uint16 else x).astype(np.float64)


__all__ += ["merge_loras", "MergeReport", "MERGE_KEYS"]
