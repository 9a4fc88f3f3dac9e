"""Adapter files and what they fuse into: sources, the plan of a fuse, and its factors.

A plan says, for every weight and bias an adapter touches, which of its tensors fuse there, as
what kind (a LoRA pair, DoRA, a LoHa, a LoKr, a full-weight difference, a bias term) and at
what scale, and
checks shapes, dtypes and combinations before anything is read or written.  Adapter modules
that match no weight, and keys of no known role, stop the fuse unless the caller allows them.
"""
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .._validate import (BLAS_INT_MAX, FP8_BY_NAME, LoHa, LoKr, bf16_to_f32, choice,
                         first_nonfinite, is_bf16, ml_fp8_format, round_up, strength_f32, where)
from ..errors import (ArgumentError, DTypeError, FormatError, KeyMatchError, NonFiniteInputError,
                      ShapeError, counted, listed)
from . import keys as keymatch
from . import peft
from .safetensors import SafetensorsFile, read_into

ALPHA_MODES = ("scale", "ignore")
FLOATS = ("BF16", "F32", "F16")
INTEGERS = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


@dataclass
class AdapterReport:
    path: str
    strength: float
    sha256: str = ""
    pairs_used: int = 0
    keys_used: int = 0
    unused_keys: list = field(default_factory=list)        # keys of no known role
    extra_tensors: list = field(default_factory=list)      # of modules the model lacks
    unmatched_modules: list = field(default_factory=list)  # modules that match no weight
    unmatched_components: dict = field(default_factory=dict)  # module -> component named
    alpha_mode: str = "scale"
    alpha_scaled: int = 0                                  # pairs scaled by alpha/rank
    alpha_ignored: int = 0                                 # pairs whose alpha was not applied
    alpha_ignored_why: dict = field(default_factory=dict)  # why not applied -> pairs
    alpha_ignored_values: list = field(default_factory=list)  # those alphas' values, each once
    alpha_source: str = ""                                 # where the applied alphas came from
    alpha_rslora: int = 0                                  # of those, scaled by alpha/sqrt(rank)
    metadata_ignored: list = field(default_factory=list)   # PEFT metadata components not read
    rounded_to_bf16: list = field(default_factory=list)    # factors stored as F32/F16
    kinds: dict = field(default_factory=dict)              # kind -> count
    settings: dict = field(default_factory=dict)           # an IC-LoRA's reference_* metadata
    repeat_of: int = None                                  # the earlier adapter this one is again
    repeat_how: str = ""                                   # "the same file", "the same bytes", ...


@dataclass
class Item:
    """One adapter's contribution to one weight."""
    source: int
    pair: keymatch.Pair
    kind: str          # "lora", "dora", "loha", "lokr" or "diff"
    scale: float       # LoRA and diff: the delta's scale; DoRA: the LoRA's own (alpha/rank);
                       # LoHa and LoKr: c = strength x alpha / dim
    strength: float    # the user's strength (DoRA blends by it)


@dataclass
class BiasItem:
    """One adapter's bias term for one model bias."""
    source: int
    key: str           # the adapter tensor (lora_B.bias or diff_b)
    scale: float


@dataclass
class Plan:
    weights: dict      # model weight key -> [Item], in adapter order
    biases: dict       # model bias key -> [BiasItem]
    reports: list      # AdapterReport per adapter


# ---- sources ----

class Source:
    """An adapter: a safetensors file, or a mapping of name -> array (fuse_state_dict)."""

    def __init__(self, source):
        if isinstance(source, (str, os.PathLike)):
            self.file = SafetensorsFile(source)
            self.name = self.file.path
            self.keys = list(self.file.tensors)
            self.metadata = self.file.metadata
        else:
            self.file = None
            self.mapping = source
            self.name = "<state dict>"
            self.keys = list(source)
            self.metadata = {}

    def shape(self, key):
        return self.file.tensors[key].shape if self.file else tuple(as_numpy(self.mapping[key]).shape)

    def dtype(self, key):
        if self.file:
            return self.file.tensors[key].dtype
        return dtype_name(as_numpy(self.mapping[key]))

    def array(self, key):
        return self.file.read(key) if self.file else as_numpy(self.mapping[key])

    def close(self):
        if self.file:
            self.file.close()


def as_numpy(tensor):
    """A numpy view of a numpy array or (zero-copy) of a CPU torch tensor."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if type(tensor).__module__.split(".")[0] == "torch":
        t = tensor.detach()
        if t.device.type != "cpu":
            raise DTypeError(f"torch tensor on {t.device}: move it to the CPU first")
        name = str(t.dtype).replace("torch.", "")
        import torch  # present, since a torch tensor is

        if name == "bfloat16":
            return t.view(torch.int16).numpy().view(np.uint16)
        if name in FP8_BY_NAME:
            return FP8View(t.view(torch.uint8).numpy(), name)
        return t.numpy()
    return np.asarray(tensor)


class FP8View(np.ndarray):
    """uint8 codes of a torch fp8 tensor, carrying which format they are."""

    def __new__(cls, array, torch_name):
        view = array.view(cls)
        view.fp8 = FP8_BY_NAME[torch_name]
        return view

    def __array_finalize__(self, obj):
        self.fp8 = getattr(obj, "fp8", None)


def dtype_name(array):
    """The safetensors dtype name of an array."""
    if isinstance(array, FP8View):
        return array.fp8
    dt = array.dtype
    if is_bf16(dt):
        return "BF16"
    if ml_fp8_format(dt):
        return ml_fp8_format(dt)
    names = {"float32": "F32", "float16": "F16", "float64": "F64", "uint8": "U8", "int8": "I8",
             "int16": "I16", "int32": "I32", "int64": "I64", "uint32": "U32", "uint64": "U64"}
    return names.get(dt.name, dt.name.upper())


# ---- the plan ----

def _alpha_value(source, key):
    value = np.asarray(source.array(key))
    if value.size != 1:
        raise ShapeError(f"{source.name}: alpha {key!r} has {value.size} elements, not one")
    dtype = source.dtype(key)
    if dtype == "BF16":
        number = float(bf16_to_f32(value).reshape(-1)[0])
    elif dtype in FLOATS + ("F64",) + INTEGERS:
        number = float(value.reshape(-1)[0])
    else:
        raise DTypeError(f"{source.name}: alpha {key!r} is {dtype}, expected a number")
    if not math.isfinite(number):
        raise NonFiniteInputError(f"{source.name}: alpha {key!r} is {number}; the pair's scale "
                                  "alpha / rank would not be finite")
    return number


def _check(source, key, shape, dtypes, what):
    got_shape, got_dtype = tuple(source.shape(key)), source.dtype(key)
    if shape is not None and got_shape != tuple(shape):
        raise ShapeError(f"{source.name}: {what} {key!r} has shape {list(got_shape)}, expected "
                         f"{list(shape)}")
    if got_dtype not in dtypes:
        raise DTypeError(f"{source.name}: {what} {key!r} is {got_dtype}; expected "
                         f"{' or '.join(dtypes)}")


def _unmatched_error(source, matched):
    parts = []
    if matched.unmatched:
        components = sorted({p.component for p in matched.unmatched if p.component})
        # each module's component named beside it only where they are not all of one
        several = len(components) > 1 or any(not p.component for p in matched.unmatched)
        named = [p.module + (f" ({p.component})" if p.component and several else "")
                 for p in matched.unmatched[:5]]
        n = len(matched.unmatched)
        text = (f"{counted(n, 'adapter module')} {'matches' if n == 1 else 'match'} no weight "
                f"of the model: {', '.join(named)}{', ...' if n > 5 else ''}")
        if components:
            text += (f"; {'its name points' if n == 1 else 'their names point'} to "
                     f"{listed('the ' + c for c in components)}, which this checkpoint does "
                     "not hold")
        parts.append(text)
    if matched.unused:
        shown = ", ".join(repr(k) for k in matched.unused[:3])
        n = len(matched.unused)
        parts.append(f"{counted(n, 'key')} {'is' if n == 1 else 'are'} not "
                     f"{'a tensor' if n == 1 else 'tensors'} of any adapter kind ltx2blas "
                     "knows (LoRA factors, alpha, DoRA magnitudes, bias terms, differences): "
                     f"{shown}{', ...' if len(matched.unused) > 3 else ''}")
    return KeyMatchError(f"{source.name}: {'; and '.join(parts)}; nothing was written "
                         "(allow_unmatched=True fuses the rest and lists these)")


def module_of_tensor(key):
    """The module a tensor key belongs to (the key without its last name), prefix stripped."""
    name, _ = keymatch.strip_prefix(key)
    return name.rpartition(".")[0] or name


#: The prefix of the metadata an IC-LoRA's loader reads at run time (reference_downscale_factor,
#: reference_temporal_scale_factor, ...): how the reference video is prepared, which a fuse
#: cannot put into the weights.
SETTINGS_PREFIX = "reference_"


def run_time_settings(metadata):
    """The adapter metadata a loader reads at run time rather than from the weights, as stored,
    by name (writers store metadata in no fixed order)."""
    return {k: metadata[k] for k in sorted(metadata) if k.startswith(SETTINGS_PREFIX)}


def make_plan(model_entries, layout_of, sources, strengths, alpha="scale",
              allow_unmatched=False, allow_repeated=True):
    """The Plan of fusing ``sources`` at ``strengths`` into a model of ``model_entries``
    (name -> (dtype, shape)); ``layout_of(key)`` gives a weight's Layout or raises.  An
    adapter given again (repeats) is reported as such, or with ``allow_repeated`` False
    refused."""
    choice(alpha, ALPHA_MODES, "alpha")
    plan = Plan({}, {}, [])
    again = repeats(sources)
    if again and not allow_repeated:
        index, (first, how) = next(iter(again.items()))
        raise ArgumentError(
            f"{sources[index].name}: adapter {index} is adapter {first} again ({how}"
            f"{'' if how == 'the same file' else ' as ' + sources[first].name}); it would be "
            "fused twice, its change added to each weight twice: give it once, at the strength "
            "meant (allow_repeated=True fuses it again)")
    for index, (source, strength) in enumerate(zip(sources, strengths)):
        report = AdapterReport(path=source.name, strength=strength, alpha_mode=alpha,
                               settings=run_time_settings(source.metadata))
        report.repeat_of, report.repeat_how = again.get(index, (None, ""))
        # upstream LTX-2 (alpha="ignore") reads no alpha, from tensors or from PEFT's metadata
        configs, report.metadata_ignored = (peft.read_configs(source.metadata, source.name)
                                            if alpha == "scale" else ({}, []))
        matched = keymatch.match(source.keys, model_entries, adapter_name=source.name)
        report.unused_keys = matched.unused
        report.extra_tensors = matched.extra
        report.unmatched_modules = [p.module for p in matched.unmatched]
        report.unmatched_components = {p.module: p.component for p in matched.unmatched
                                       if p.component}
        if (matched.unmatched or matched.unused) and not allow_unmatched:
            raise _unmatched_error(source, matched)
        for pair in matched.pairs:
            _plan_pair(plan, index, source, strength, pair, layout_of, model_entries, report,
                       alpha, configs)
        plan.reports.append(report)
    for target, items in plan.weights.items():
        if any(item.kind == "dora" for item in items) and len(items) > 1:
            raise KeyMatchError(f"weight {target}: a DoRA adapter rescales the whole weight and "
                                f"is not combined with others on it ({len(items)} adapters "
                                "touch it)")
    return plan


def repeats(sources):
    """{index: (the first adapter it repeats, how)} of the sources that are an earlier one
    again: the same file (one inode, under one name or two), the same bytes (a copy), or the
    same mapping.  A user almost never means to add one adapter twice; a file's bytes are
    compared only where two files have the same size, and only as far as they agree."""
    out = {}
    for j, b in enumerate(sources):
        for i, a in enumerate(sources[:j]):
            if i in out:
                continue  # compared with the first of its kind
            how = _same_adapter(a, b)
            if how:
                out[j] = (i, how)
                break
    return out


def _same_adapter(a, b):
    """How Source ``b`` is Source ``a`` again, or ""."""
    if a.file is None or b.file is None:
        return "the same mapping" if a.file is b.file is None and a.mapping is b.mapping else ""
    sa, sb = os.fstat(a.file._fd), os.fstat(b.file._fd)
    if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
        return "the same file"
    if sa.st_size != sb.st_size or a.file.data_start != b.file.data_start:
        return ""
    chunk = 1 << 20
    x, y = np.empty(chunk, np.uint8), np.empty(chunk, np.uint8)
    for offset in range(0, sa.st_size, chunk):
        n = min(chunk, sa.st_size - offset)
        read_into(a.file._fd, x[:n], offset, a.name)
        read_into(b.file._fd, y[:n], offset, b.name)
        if not np.array_equal(x[:n], y[:n]):
            return ""
    return "the same bytes"


def _plan_pair(plan, index, source, strength, pair, layout_of, model_entries, report, alpha,
               configs):
    if pair.kind == "diff" and len(model_entries[pair.target][1]) == 1:
        _plan_vector_diff(plan, index, source, strength, pair, model_entries, report)
        return
    layout = layout_of(pair.target)
    out_f, in_f = layout.shape
    where = f"weight {pair.target} [{out_f}, {in_f}]" + (
        f" ({layout.kind}, stored {list(model_entries[pair.target][1])})" if layout.quantized else "")
    keys = pair.keys
    rank = None
    if pair.kind == "lora":
        a_shape, b_shape = source.shape(pair.a), source.shape(pair.b)
        if len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] != b_shape[1]:
            raise ShapeError(f"{source.name}: {pair.module}: lora_A {pair.a!r} {list(a_shape)} "
                             f"has rank {a_shape[0]} but lora_B {pair.b!r} {list(b_shape)} has "
                             f"rank {b_shape[1]}; the two factors of a pair share one rank")
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_f or \
                b_shape[0] != out_f:
            raise ShapeError(f"{source.name}: {pair.module}: lora_A {list(a_shape)} and lora_B "
                             f"{list(b_shape)} do not fit {where}")
        rank = a_shape[0]
        if rank > BLAS_INT_MAX:
            raise ShapeError(f"{source.name}: {pair.module}: rank {rank} exceeds the BLAS "
                             f"integer range ({BLAS_INT_MAX})")
    elif pair.kind == "diff":
        _check(source, keys["diff"], (out_f, in_f), FLOATS, "diff")
    elif pair.kind in ("loha", "lokr"):
        dim = _lycoris_dim(source, pair, (out_f, in_f), where)
        scale = _lycoris_scale(source, pair, dim, alpha, strength, report)
        strength_f32(scale, f"{source.name}: {pair.module}: the scale (strength x alpha / dim, "
                            f"strength {strength:g})")
        plan.weights.setdefault(pair.target, []).append(Item(index, pair, pair.kind, scale,
                                                             strength))
        report.pairs_used += 1
        report.kinds[pair.kind] = report.kinds.get(pair.kind, 0) + 1
        report.keys_used += len(keys)
        return
    scale_at = _scale_rule(configs, source, pair, rank, alpha, report) if \
        pair.kind == "lora" else (lambda w: w)
    kind = pair.kind
    if pair.kind == "lora" and ({"magnitude", "dora_scale"} & set(keys)):
        kind = "dora"
        mkey = keys.get("magnitude") or keys["dora_scale"]
        shapes = [(out_f,), (out_f, 1)] if "magnitude" in keys else [(out_f, 1), (1, in_f)]
        if tuple(source.shape(mkey)) not in shapes:
            raise ShapeError(f"{source.name}: DoRA magnitude {mkey!r} has shape "
                             f"{list(source.shape(mkey))}; {where} takes "
                             f"{' or '.join(str(list(s)) for s in shapes)}")
        _check(source, mkey, None, ("F32", "BF16"), "DoRA magnitude")
        if layout.kind != "bf16":
            raise DTypeError(f"{source.name}: {pair.module} is a DoRA adapter; ltx2blas fuses "
                             f"DoRA into bf16 weights, and {pair.target} is {layout.kind}")
    if pair.kind in ("lora", "diff"):
        # a LoRA's delta scales by its scale at the strength; DoRA applies its scale at 1
        # (alpha/rank) inside and blends by strength; a difference has no alpha
        scale = scale_at(1.0) if kind == "dora" else scale_at(strength)
        if kind != "diff":
            strength_f32(scale, f"{source.name}: {pair.module}: the scale (strength x alpha / "
                                f"rank, strength {strength:g})")
        plan.weights.setdefault(pair.target, []).append(Item(index, pair, kind, scale, strength))
        report.pairs_used += 1
        report.kinds[kind] = report.kinds.get(kind, 0) + 1
    for role, bias_scale in (("up_bias", scale_at(strength)), ("diff_b", strength)):
        if role not in keys:
            continue
        if pair.bias_target is None:
            raise KeyMatchError(f"{source.name}: {keys[role]!r} is a bias term, but the model's "
                                f"{pair.target[:-len('.weight')]} has no bias")
        bias_dtype, bias_shape = model_entries[pair.bias_target]
        if bias_dtype not in FLOATS or tuple(bias_shape) != (out_f,):
            raise DTypeError(f"bias {pair.bias_target} is {bias_dtype} {list(bias_shape)}; ltx2blas "
                             f"adds bias terms to {'/'.join(FLOATS)} biases of {out_f} values")
        _check(source, keys[role], (out_f,), FLOATS, "bias term")
        plan.biases.setdefault(pair.bias_target, []).append(
            BiasItem(index, keys[role], bias_scale))
        report.kinds["bias"] = report.kinds.get("bias", 0) + 1
        if pair.kind == "bias":
            report.pairs_used += 1
    report.keys_used += len(keys)


def _plan_vector_diff(plan, index, source, strength, pair, model_entries, report):
    """A full difference of a 1-D weight (a norm's scale): added as a bias term is (§1, bias
    terms: the sum in f32, rounded once into the weight's dtype), which is ComfyUI's f32 add."""
    dtype, shape = model_entries[pair.target]
    if dtype not in FLOATS:
        raise DTypeError(f"weight {pair.target} is {dtype} {list(shape)}; a difference is added "
                         f"to {'/'.join(FLOATS)} vectors")
    for role in pair.keys:
        if role not in ("diff", "diff_b"):
            raise KeyMatchError(f"{source.name}: {pair.keys[role]!r} beside a difference of the "
                                f"vector {pair.target}")
    _check(source, pair.keys["diff"], tuple(shape), FLOATS, "diff")
    plan.biases.setdefault(pair.target, []).append(BiasItem(index, pair.keys["diff"], strength))
    report.pairs_used += 1
    report.kinds["diff"] = report.kinds.get("diff", 0) + 1
    report.keys_used += 1
    if "diff_b" in pair.keys:
        if pair.bias_target is None:
            raise KeyMatchError(f"{source.name}: {pair.keys['diff_b']!r} is a bias term, but the "
                                f"model's {pair.target[:-len('.weight')]} has no bias")
        _check(source, pair.keys["diff_b"], tuple(shape), FLOATS, "bias term")
        plan.biases.setdefault(pair.bias_target, []).append(
            BiasItem(index, pair.keys["diff_b"], strength))
        report.kinds["bias"] = report.kinds.get("bias", 0) + 1
        report.keys_used += 1


def _lycoris_dim(source, pair, shape, where):
    """A LoHa's or LoKr's ``dim``, the rank its alpha divides by (None for a LoKr whose factors
    are both whole), once its factors are found to fit the weight: a LoHa's the rank of
    hada_w1_b; a LoKr's the rank of w2's pair if it has one, else of w1's, as ComfyUI takes
    them."""
    out_f, in_f = shape
    keys = pair.keys

    def two_d(role):
        got = tuple(source.shape(keys[role]))
        if len(got) != 2:
            raise ShapeError(f"{source.name}: {keys[role]!r} has shape {list(got)}; the factors "
                             f"of {where} are 2-D")
        if max(got) > BLAS_INT_MAX:
            # an empty tensor may claim any shape; one this large is no factor of a weight,
            # and numpy would refuse even to shape its zero elements
            raise FormatError(f"{source.name}: {keys[role]!r} has shape {list(got)}, a "
                              f"dimension past {BLAS_INT_MAX}; no factor of {where} is that "
                              "large")
        _check(source, keys[role], None, FLOATS, "factor")
        return got

    if pair.kind == "loha":
        shapes = {role: two_d(role) for role in keymatch.LOHA_ROLES}
        for n in ("1", "2"):
            a, b = shapes[f"hada_w{n}_a"], shapes[f"hada_w{n}_b"]
            if a[1] != b[0]:
                raise ShapeError(f"{source.name}: {pair.module}: hada_w{n}_a {list(a)} has rank "
                                 f"{a[1]} but hada_w{n}_b {list(b)} has rank {b[0]}; the two "
                                 "factors of a pair share one rank")
            if a[0] != out_f or b[1] != in_f or a[1] == 0:
                raise ShapeError(f"{source.name}: {pair.module}: hada_w{n}_a {list(a)} and "
                                 f"hada_w{n}_b {list(b)} do not fit {where}")
        return shapes["hada_w1_b"][0]
    factors, dims = [], []
    for n in ("1", "2"):
        if f"lokr_w{n}" in keys:
            factors.append(two_d(f"lokr_w{n}"))
            dims.append(None)
            continue
        a, b = two_d(f"lokr_w{n}_a"), two_d(f"lokr_w{n}_b")
        if a[1] != b[0] or a[1] == 0:
            raise ShapeError(f"{source.name}: {pair.module}: lokr_w{n}_a {list(a)} and "
                             f"lokr_w{n}_b {list(b)} do not multiply (ranks {a[1]} and {b[0]})")
        factors.append((a[0], b[1]))
        dims.append(b[0])
    (m1, n1), (m2, n2) = factors
    if (m1 * m2, n1 * n2) != (out_f, in_f):
        raise ShapeError(f"{source.name}: {pair.module}: the Kronecker product of w1 {[m1, n1]} "
                         f"and w2 {[m2, n2]} is [{m1 * m2}, {n1 * n2}], not {where}")
    if max(m1, m2) > out_f or max(n1, n2) > in_f:
        # only beside an empty weight (a zero dimension in the other factor): a factor is
        # computed in f32 before the product, and one larger than its weight has no place
        raise ShapeError(f"{source.name}: {pair.module}: w1 {[m1, n1]} and w2 {[m2, n2]} are "
                         f"factors larger than {where} they multiply to")
    return dims[1] if dims[1] is not None else dims[0]


def _lycoris_scale(source, pair, dim, alpha, strength, report):
    """A LoHa's or LoKr's scale c, as ComfyUI computes it: strength x (alpha / dim) in Python's
    double arithmetic where the module has an .alpha and a dim, else the strength (an alpha
    beside two whole LoKr factors is not applied, there as here)."""
    if pair.alpha is None:
        return strength
    if alpha != "scale" or dim is None:
        _alpha_ignored(report, source, pair.alpha, "alpha='ignore'" if alpha != "scale" else
                       "a LoKr of two whole factors has no rank to divide it by")
        return strength
    report.alpha_scaled += 1
    _alpha_source(report, "its .alpha tensors")
    return strength * (_alpha_value(source, pair.alpha) / dim)


def _scale_rule(configs, source, pair, rank, alpha, report):
    """A LoRA pair's scale at adapter weight w, as the file says it: PEFT's (w x alpha_m) / r_m
    from the lora_adapter_metadata diffusers writes, once the tensors are found to agree with
    it; w x (alpha / rank) from a .alpha tensor (ComfyUI, kohya); w alone without either, or
    with alpha="ignore" (upstream LTX-2)."""
    config, component = peft.config_of(configs, pair.a, source.name)
    if config is None:
        said = pair.alpha is not None or peft.METADATA_KEY in source.metadata
        if alpha != "scale" or not rank or pair.alpha is None:
            if said:
                _alpha_ignored(report, source, pair.alpha, "alpha='ignore'" if alpha != "scale"
                               else "a pair of rank 0 has none to divide it by")
            return lambda w: w
        lora_scale = _alpha_value(source, pair.alpha) / rank
        report.alpha_scaled += 1
        _alpha_source(report, "its .alpha tensors")
        return lambda w: w * lora_scale
    name = keymatch.to_diffusers(keymatch.strip_prefix(pair.module[len(component):])[0])
    r_m, alpha_m = config.rank_and_alpha(name)
    where = f"{source.name}: {pair.module}: its {peft.METADATA_KEY} ({config.describe()})"
    if r_m != rank:
        raise FormatError(f"{where} gives rank {r_m}, but its lora_A has {rank} rows; the "
                          "metadata does not describe these tensors")
    dora = bool({"magnitude", "dora_scale"} & set(pair.keys))
    if dora != config.use_dora:
        raise FormatError(f"{where} says use_dora {str(config.use_dora).lower()}, but the module "
                          f"{'has' if dora else 'has no'} DoRA magnitudes")
    if "up_bias" in pair.keys and not config.lora_bias:
        raise FormatError(f"{where} says lora_bias false, but the file holds "
                          f"{pair.keys['up_bias']!r}, which PEFT would then not load")
    if pair.alpha is not None and _alpha_value(source, pair.alpha) != alpha_m:
        raise FormatError(f"{where} gives alpha {alpha_m:g}, but {pair.alpha!r} holds "
                          f"{_alpha_value(source, pair.alpha):g}")
    report.alpha_scaled += 1
    report.alpha_rslora += config.use_rslora
    _alpha_source(report, f"its {peft.METADATA_KEY} ({config.describe()})")
    return lambda w: config.scale(w, rank, alpha_m)


def _alpha_ignored(report, source, key, why):
    """Count a pair whose alpha is not applied, why, and the alpha's value where its .alpha
    tensor holds one readable number (the summary names it; a tensor that is not one is not
    read, as an alpha not applied never was)."""
    report.alpha_ignored += 1
    report.alpha_ignored_why[why] = report.alpha_ignored_why.get(why, 0) + 1
    if key is None or math.prod(source.shape(key)) != 1:
        return
    try:
        value = _alpha_value(source, key)
    except (ShapeError, DTypeError, NonFiniteInputError):
        return
    if value not in report.alpha_ignored_values:
        report.alpha_ignored_values.append(value)


def _alpha_source(report, text):
    if text not in report.alpha_source.split("; "):
        report.alpha_source = f"{report.alpha_source}; {text}" if report.alpha_source else text


# ---- factors ----

def _bf16_keys(item):
    """The adapter tensors of an item that are read as bf16 (into the reader's space)."""
    if item.kind in ("loha", "lokr"):
        roles = keymatch.LOHA_ROLES if item.kind == "loha" else keymatch.LOKR_ROLES
        return tuple(item.pair.keys[r] for r in roles if r in item.pair.keys)
    return (item.pair.keys["diff"],) if item.kind == "diff" else (item.pair.a, item.pair.b)


def factor_space(items, sources):
    """Bytes that ``factors`` places in its ``space``."""
    return sum(round_up(2 * math.prod(sources[it.source].shape(key)), 64)
               for it in items for key in _bf16_keys(it))


def factor_bf16(source, key, report, space=None):
    """An adapter tensor as bf16 bits; F32/F16 ones are rounded to bf16 (docs/arithmetic.md §1 multiplies
    bf16 factors) and recorded in the report.  A bf16 tensor of a file is read into ``space``
    (uint8, at least its size) when given."""
    from .. import _quant

    dtype = source.dtype(key)
    if dtype == "BF16" and source.file is not None and space is not None:
        shape = source.shape(key)
        bits = source.file.read(key, space[:2 * math.prod(shape)].view(np.uint16).reshape(shape))
        return refuse_nonfinite(source, key, bits)
    array = source.array(key)
    if dtype == "BF16":
        bits = np.ascontiguousarray(array.view(np.uint16) if array.dtype != np.uint16 else array)
        return refuse_nonfinite(source, key, bits)
    if dtype in ("F32", "F16"):
        report.rounded_to_bf16.append(key)
        values = np.ascontiguousarray(array, dtype=np.float32)
        bits = _quant.round_bf16(values.reshape(-1)).reshape(values.shape)
        refuse_nonfinite(source, key, bits, values)
        return bits
    raise DTypeError(f"{source.name}: adapter tensor {key!r} is {dtype}; expected BF16 (or "
                     "F32/F16)")


def refuse_nonfinite(source, key, array, stored=None):
    """``array`` (bf16 bits, f16 or f32), or NonFiniteInputError naming the file, the tensor and
    the element where it holds inf or NaN.  An adapter tensor is always checked as it is read:
    a scan of bytes just read, whereas one NaN would spread through a whole row and column of
    the fused weight.  ``stored``: the values as the file holds them, when ``array`` is their
    rounding to bf16 (a finite f32 past bf16's range rounds to inf)."""
    first = first_nonfinite(array)
    if first < 0:
        return array
    at = where(first, array.shape)
    shown = stored if stored is not None else (bf16_to_f32(array) if array.dtype == np.uint16
                                               else array)
    value = float(shown[at])
    rounds = f" (rounds to {float(bf16_to_f32(array)[at])} in bf16)" if stored is not None and \
        math.isfinite(value) else ""
    raise NonFiniteInputError(f"{source.name}: adapter tensor {key!r} holds {value} at "
                              f"{at}{rounds}; a non-finite adapter makes every value it touches "
                              "non-finite, so nothing is fused")


@dataclass
class Loaded:
    """An item's tensors, ready to fuse."""
    item: Item
    arrays: tuple      # LoRA/DoRA (A, B); diff (diff,); LoHa, LoKr: their factors by role, in
                       # keys.LOHA_ROLES / LOKR_ROLES order
    magnitude: np.ndarray = None

    def adapter(self):
        """The array API's adapter: (A, B, scale), (diff, scale), a LoHa or a LoKr."""
        it = self.item
        if it.kind == "loha":
            return LoHa(*self.arrays, it.scale)
        if it.kind == "lokr":
            roles = [r for r in keymatch.LOKR_ROLES if r in it.pair.keys]
            by_role = dict(zip(roles, self.arrays))

            def factor(name):
                return by_role[name] if name in by_role else (by_role[name + "_a"],
                                                              by_role[name + "_b"])
            return LoKr(factor("lokr_w1"), factor("lokr_w2"), it.scale)
        return (*self.arrays, it.scale)

    def key_of(self, tensor):
        """The file's key of a tensor the array API names (lora_a, w1_b, diff, ...)."""
        keys = self.item.pair.keys
        role = {"lora_a": "down", "lora_b": "up"}.get(tensor, tensor)
        if self.item.kind in ("loha", "lokr"):
            role = ("hada_" if self.item.kind == "loha" else "lokr_") + tensor
        return keys.get(role) or keys.get("diff")


def factors(items, sources, reports, space=None):
    """[Loaded] of one weight's items, bf16 tensors read into ``space`` (uint8,
    factor_space bytes) when given."""
    out, at = [], 0
    for it in items:
        arrays = []
        for key in _bf16_keys(it):
            arrays.append(factor_bf16(sources[it.source], key, reports[it.source],
                                      None if space is None else space[at:]))
            at += round_up(2 * math.prod(sources[it.source].shape(key)), 64)
        magnitude = None
        if it.kind == "dora":
            keys = it.pair.keys
            mkey = keys.get("magnitude") or keys["dora_scale"]
            magnitude = np.ascontiguousarray(sources[it.source].array(mkey))
            if sources[it.source].dtype(mkey) == "BF16":
                magnitude = magnitude.view(np.uint16)
            refuse_nonfinite(sources[it.source], mkey, magnitude)
            if "magnitude" in keys:
                magnitude = magnitude.reshape(-1)
        out.append(Loaded(it, tuple(arrays), magnitude))
    return out


def bias_terms(items, sources):
    """[(b, scale)] of one bias's items, as stored (bf16 bits, f16 or f32)."""
    terms = []
    for it in items:
        b = np.ascontiguousarray(sources[it.source].array(it.key))
        if sources[it.source].dtype(it.key) == "BF16":
            b = b.view(np.uint16)
        refuse_nonfinite(sources[it.source], it.key, b)
        terms.append((b.reshape(-1), it.scale))
    return terms


def gflop(shape, items, sources):
    """The products' floating-point work of one weight's items, in GFLOP: 2 x rows x cols x
    rank per low-rank product over the weight (a LoHa has two), a LoKr's factors' own
    products, and one operation an element for a Kronecker or element-wise pass."""
    out_f, in_f = shape

    def work(it):
        if it.kind == "diff":
            return 0.0
        if it.kind in ("lora", "dora"):
            return 2.0 * out_f * in_f * sources[it.source].shape(it.pair.a)[0]
        keys, total = it.pair.keys, float(out_f * in_f)
        for n in ("1", "2"):
            role = f"hada_w{n}" if it.kind == "loha" else f"lokr_w{n}"
            if role + "_a" in keys:
                (m, r), cols = sources[it.source].shape(keys[role + "_a"]), \
                    sources[it.source].shape(keys[role + "_b"])[1]
                total += 2.0 * m * r * cols
        return total
    return sum(work(it) for it in items) / 1e9
