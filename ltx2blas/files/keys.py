"""Which adapter tensors go with which model weight.

Model weights: ``<prefix><module>.weight``, prefix ``model.diffusion_model.`` (LTX-2 single-file
checkpoints), ``diffusion_model.``, ``transformer.`` or none.

Adapters: ``<prefix><module>.lora_A.weight`` / ``.lora_B.weight`` (LTX-2, PEFT; prefix
``diffusion_model.``, ``model.diffusion_model.``, ``transformer.``, ``base_model.model.`` or
none), ``.lora_down.weight`` / ``.lora_up.weight`` with an optional ``.alpha`` (kohya, ComfyUI),
and kohya's flattened names, ``lora_unet_<module with dots as underscores>.lora_down.weight``.

A module's A without its B (or B without A), an alpha without a pair, and an adapter file whose
pairs match no weight are errors; keys that are not LoRA factors, and pairs that match no
weight, are reported as unused.
"""
from dataclasses import dataclass, field

from ..errors import KeyMatchError

MODEL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
ADAPTER_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "transformer.",
                    "base_model.model.", "lora_unet_", "lora_transformer_")
SUFFIXES = {
    ".lora_A.weight": "a", ".lora_B.weight": "b",
    ".lora_A.default.weight": "a", ".lora_B.default.weight": "b",
    ".lora_down.weight": "a", ".lora_up.weight": "b",
    ".alpha": "alpha",
}


def model_module(key):
    """The module a model key's ``.weight`` belongs to, prefix stripped, or None."""
    if not key.endswith(".weight"):
        return None
    module = key[: -len(".weight")]
    for prefix in MODEL_PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):]
    return module


@dataclass
class Pair:
    """One adapter module: the keys of its factors (and alpha), and the model key it fuses into."""
    module: str
    a: str = None
    b: str = None
    alpha: str = None
    target: str = None


@dataclass
class AdapterMatch:
    pairs: list = field(default_factory=list)     # matched Pairs
    unmatched: list = field(default_factory=list)  # Pairs whose module matches no weight
    unused: list = field(default_factory=list)     # keys that are not LoRA factors at all


def _strip_adapter_prefix(module):
    for prefix in ADAPTER_PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):], prefix
    return module, ""


def match(adapter_keys, model_keys, adapter_name="adapter"):
    """Pair the adapter's keys by module and find each pair's model weight.

    ``model_keys``: the checkpoint's tensor names.  Raises KeyMatchError for an incomplete
    pair, an alpha without a pair, or an adapter in which no pair matches a weight."""
    exact, flat = {}, {}
    for key in model_keys:
        module = model_module(key)
        if module is None:
            continue
        exact[module] = key
        flat.setdefault(module.replace(".", "_"), []).append(key)

    modules, unused = {}, []
    for key in adapter_keys:
        for suffix, role in SUFFIXES.items():
            if key.endswith(suffix):
                name = key[: -len(suffix)]
                pair = modules.setdefault(name, Pair(module=name))
                if getattr(pair, role) is not None:
                    raise KeyMatchError(f"{adapter_name}: two {role} tensors for module {name!r} "
                                        f"({getattr(pair, role)!r} and {key!r})")
                setattr(pair, role, key)
                break
        else:
            unused.append(key)

    result = AdapterMatch(unused=unused)
    for name, pair in modules.items():
        if pair.a is None or pair.b is None:
            have = pair.a or pair.b or pair.alpha
            missing = "lora_A/lora_down" if pair.a is None else "lora_B/lora_up"
            if pair.a is None and pair.b is None:
                raise KeyMatchError(f"{adapter_name}: alpha {have!r} has no lora factors beside it")
            raise KeyMatchError(f"{adapter_name}: {have!r} has no {missing} partner")
        stripped, prefix = _strip_adapter_prefix(name)
        target = exact.get(stripped)
        if target is None and prefix in ("lora_unet_", "lora_transformer_", ""):
            candidates = flat.get(stripped.replace(".", "_"), [])
            if len(candidates) == 1:
                target = candidates[0]
            elif len(candidates) > 1:
                raise KeyMatchError(f"{adapter_name}: module {name!r} matches several weights "
                                    f"({', '.join(candidates[:3])})")
        pair.target = target
        (result.pairs if target else result.unmatched).append(pair)
    if not result.pairs:
        sample = ", ".join(sorted(modules)[:3]) or ", ".join(sorted(unused)[:3]) or "(none)"
        raise KeyMatchError(f"{adapter_name}: matches no weight of the model (adapter modules "
                            f"such as {sample})")
    return result
