"""Which adapter tensors go with which model weight, in every spelling the field uses.

An adapter key is ``<prefix><module><suffix>``.  The suffix says the tensor's role (ROLES: the
LoRA factors in seven spellings, LyCORIS' LoHa and LoKr factors, alpha, DoRA's magnitude,
biases, a full-weight difference, and the kinds ltx2blas does not fuse); the prefix is stripped (ADAPTER_PREFIXES); the module is then
looked up among the model's modules under every name they go by: as stored, LTX-2's and
diffusers' names for the transformer (RENAMES, both ways), and kohya's flattened form with dots
as underscores.  Model weights are ``<prefix><module>.weight`` (MODEL_PREFIXES).

Every module of an adapter file becomes a Pair of one kind ("lora", "loha", "lokr", "diff",
"bias"), or an error: a factor without its partner, an alpha or magnitude without a pair, a
kind that is not fused (LoCon's lora_mid, the Tucker forms of LoHa and LoKr, GLoRA, OFT/BOFT,
ComfyUI's set and reshape patches).
Pairs that match no weight are returned as unmatched, each with the component it belongs to
where the name says (text encoder, connectors, VAE); keys of no known role as unused, except
the tensors of modules the model does not have at all (an adapter's own module, such as an
IC-LoRA's reference slot embedding), which are returned as extra: they are no change to any
weight of the model, and a fused checkpoint, which holds only the model's tensors, leaves them
out, as upstream LTX-2's loader does.
"""
from dataclasses import dataclass, field

from ..errors import KeyMatchError

MODEL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
ADAPTER_PREFIXES = ("base_model.model.diffusion_model.", "model.diffusion_model.",
                    "diffusion_model.", "base_model.model.", "transformer.", "unet.",
                    "lycoris_", "lora_unet_", "lora_transformer_")
#: prefixes whose module names are flattened (dots written as underscores)
FLAT_PREFIXES = ("lycoris_", "lora_unet_", "lora_transformer_")

#: suffix -> role, in the spellings of LTX-2's trainer, PEFT, diffusers, kohya and ComfyUI
ROLES = {
    ".lora_down.weight": "down", "_lora.down.weight": "down", ".lora_A.weight": "down",
    ".lora.down.weight": "down", ".lora_A": "down", ".lora_linear_layer.down.weight": "down",
    ".lora_A.default.weight": "down",
    ".lora_up.weight": "up", "_lora.up.weight": "up", ".lora_B.weight": "up",
    ".lora.up.weight": "up", ".lora_B": "up", ".lora_linear_layer.up.weight": "up",
    ".lora_B.default.weight": "up",
    ".alpha": "alpha",
    ".lora_magnitude_vector": "magnitude", ".lora_magnitude_vector.weight": "magnitude",
    ".lora_magnitude_vector.default.weight": "magnitude",
    ".dora_scale": "dora_scale",
    ".lora_B.bias": "up_bias", ".lora_up.bias": "up_bias",
    ".diff": "diff", ".diff_b": "diff_b",
    # LyCORIS (its own files, kohya's and ComfyUI's spellings are the same suffixes)
    ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b", ".hada_w2_a": "hada_w2_a",
    ".hada_w2_b": "hada_w2_b",
    ".lokr_w1": "lokr_w1", ".lokr_w1_a": "lokr_w1_a", ".lokr_w1_b": "lokr_w1_b",
    ".lokr_w2": "lokr_w2", ".lokr_w2_a": "lokr_w2_a", ".lokr_w2_b": "lokr_w2_b",
}
#: The roles of each LyCORIS kind's factors, by kind
LOHA_ROLES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_ROLES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
#: suffix -> the adapter kind it belongs to, for the kinds that are refused
#: (each with its article, so that a message reads "belongs to an OFT/BOFT adapter")
REFUSED = {
    ".lora_mid.weight": "a LoCon with a Tucker core (lora_mid)",
    # LyCORIS writes Tucker cores for convolutions only; LTX-2's adapted weights are Linears
    ".hada_t1": "a LoHa with a Tucker core (hada_t1, a convolution's form)",
    ".hada_t2": "a LoHa with a Tucker core (hada_t2, a convolution's form)",
    ".lokr_t1": "a LoKr with a Tucker core (lokr_t1, a convolution's form)",
    ".lokr_t2": "a LoKr with a Tucker core (lokr_t2, a convolution's form)",
    ".a1.weight": "a GLoRA", ".a2.weight": "a GLoRA", ".b1.weight": "a GLoRA",
    ".b2.weight": "a GLoRA",
    ".oft_blocks": "an OFT/BOFT", ".rescale": "an OFT/BOFT",
    ".set_weight": "a weight-replacing (set_weight)",
    ".reshape_weight": "a reshaping LoRA (reshape_weight)",
    ".w_norm": "a norm-layer difference (w_norm)", ".b_norm": "a norm-layer difference (b_norm)",
}
_SUFFIXES = sorted({**ROLES, **REFUSED}, key=len, reverse=True)  # longest first

#: LTX-2's transformer names -> diffusers', in diffusers' order (its LTX-2 converters): plain
#: substring replacements, then the two anchored at the start of the name.  Read backwards for
#: diffusers -> LTX-2.
RENAMES = (
    ("patchify_proj", "proj_in", False),
    ("audio_patchify_proj", "audio_proj_in", False),
    ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift", False),
    ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate", False),
    ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift", False),
    ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate", False),
    ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table", False),
    ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table", False),
    ("q_norm", "norm_q", False),
    ("k_norm", "norm_k", False),
    ("audio_prompt_adaln_single", "audio_prompt_adaln", False),
    ("prompt_adaln_single", "prompt_adaln", False),
    ("adaln_single.", "time_embed.", True),
    ("audio_adaln_single.", "audio_time_embed.", True),
)

#: where a module that matches no transformer weight belongs, by a fragment of its name
COMPONENTS = (
    ("text encoder", ("lora_te", "text_encoder", "text_model", "te1_", "te2_", "gemma")),
    ("connectors", ("embeddings_connector", "text_embedding_projection", "aggregate_embed",
                    "connectors.", "video_connector", "audio_connector", "text_proj_in")),
    ("VAE", ("vae.", "vae_", "vocoder", "decoder.", "encoder.")),
)


def _replace(name, old, new, anchored):
    """``old`` -> ``new`` in ``name`` (only at the start if anchored), leaving an occurrence
    that already reads ``new`` alone: where ``new`` extends ``old`` ("prompt_adaln" ->
    "prompt_adaln_single"), a second entry must not extend it again."""
    extends = len(new) > len(old) and new.startswith(old)
    if anchored:
        if name.startswith(old) and not (extends and name.startswith(new)):
            return new + name[len(old):]
        return name
    out, at = [], 0
    while (hit := name.find(old, at)) >= 0:
        if extends and name.startswith(new, hit):
            out.append(name[at:hit + len(new)])
            at = hit + len(new)
        else:
            out.append(name[at:hit] + new)
            at = hit + len(old)
    return "".join(out) + name[at:]


def to_diffusers(name):
    """An LTX-2 transformer module name in diffusers' naming."""
    for ltx, diff, anchored in RENAMES:
        name = _replace(name, ltx, diff, anchored)
    return name


def to_ltx(name):
    """A diffusers LTX-2 transformer module name in LTX-2's naming."""
    for ltx, diff, anchored in reversed(RENAMES):
        name = _replace(name, diff, ltx, anchored)
    return name


def model_module(key):
    """The module a model key's ``.weight`` belongs to, prefix stripped, or None."""
    if not key.endswith(".weight"):
        return None
    module = key[: -len(".weight")]
    for prefix in MODEL_PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):]
    return module


def component(module):
    """The model component an adapter module's name points to, or None (the transformer)."""
    for name, fragments in COMPONENTS:
        if any(f in module for f in fragments):
            return name
    return None


@dataclass
class Pair:
    """One adapter module: its tensors by role, its kind, and the model keys it fuses into."""
    module: str
    kind: str = None        # "lora", "loha", "lokr", "diff" or "bias"
    keys: dict = field(default_factory=dict)   # role -> adapter key
    target: str = None      # the model weight key (every kind but "bias")
    bias_target: str = None  # the model bias key (an up_bias or diff_b)
    component: str = None   # for an unmatched pair: where its name says it belongs

    @property
    def a(self):
        return self.keys.get("down")

    @property
    def b(self):
        return self.keys.get("up")

    @property
    def alpha(self):
        return self.keys.get("alpha")


@dataclass
class AdapterMatch:
    pairs: list = field(default_factory=list)      # matched Pairs
    unmatched: list = field(default_factory=list)  # Pairs whose module matches no weight
    unused: list = field(default_factory=list)     # keys of no known role
    extra: list = field(default_factory=list)      # tensors of modules the model does not have


def split_key(key):
    """(module, suffix) of an adapter key, or (None, None) for a key of no known role."""
    for suffix in _SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix
    return None, None


def strip_prefix(module):
    """(the module name without its adapter prefix, the prefix)."""
    for prefix in ADAPTER_PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):], prefix
    return module, ""


class ModelIndex:
    """The model's modules under every name an adapter may use for them."""

    def __init__(self, model_keys):
        self.weights, self.biases, self.by_name = {}, set(), {}
        for key in model_keys:
            if key.endswith(".bias"):
                self.biases.add(key)
            module = model_module(key)
            if module is None:
                continue
            self.weights[module] = key
            for spelling in {module, to_diffusers(module), to_ltx(module)}:
                for name in {spelling, spelling.replace(".", "_")}:
                    self.by_name.setdefault(name, set()).add(module)

    def find(self, name, adapter_name):
        """The model module ``name`` refers to, or None."""
        if name in self.weights:
            return name
        hits = self.by_name.get(name) or self.by_name.get(name.replace(".", "_"))
        if not hits:
            return None
        if len(hits) > 1:
            raise KeyMatchError(f"{adapter_name}: module {name!r} matches several weights "
                                f"({', '.join(sorted(self.weights[h] for h in hits)[:3])})")
        return next(iter(hits))


def _lycoris_kind(pair, roles, adapter_name):
    """"loha" or "lokr" for a module with LyCORIS factors, or the error naming what is wrong."""
    name = pair.module
    loha, lokr = roles & set(LOHA_ROLES), roles & set(LOKR_ROLES)
    if loha and lokr or roles & {"down", "up", "diff"}:
        raise KeyMatchError(f"{adapter_name}: module {name!r} mixes the tensors of two adapter "
                            f"kinds ({', '.join(sorted(roles))})")
    if "dora_scale" in roles:
        raise KeyMatchError(f"{adapter_name}: {pair.keys['dora_scale']!r}: a LoHa or LoKr with "
                            "DoRA's weight decomposition, which ltx2blas does not fuse")
    extra = roles - loha - lokr - {"alpha"}
    if extra:
        raise KeyMatchError(f"{adapter_name}: module {name!r}: {sorted(extra)} beside "
                            f"{'LoHa' if loha else 'LoKr'} factors")
    if loha:
        missing = [r for r in LOHA_ROLES if r not in roles]
        if missing:
            raise KeyMatchError(f"{adapter_name}: module {name!r} is a LoHa without "
                                f"{', '.join('.' + r for r in missing)}")
        return "loha"
    for factor in ("lokr_w1", "lokr_w2"):
        halves = {f"{factor}_a", f"{factor}_b"} & roles
        if factor in roles and halves:
            raise KeyMatchError(f"{adapter_name}: module {name!r} holds .{factor} whole and as "
                                f"the pair {', '.join('.' + h for h in sorted(halves))}")
        if factor not in roles and len(halves) != 2:
            have = f" (it has .{next(iter(halves))} alone)" if halves else ""
            raise KeyMatchError(f"{adapter_name}: module {name!r} is a LoKr without .{factor} or "
                                f".{factor}_a and .{factor}_b{have}")
    return "lokr"


def _kind(pair, adapter_name):
    roles = set(pair.keys)
    name = pair.module
    if roles & (set(LOHA_ROLES) | set(LOKR_ROLES)):
        return _lycoris_kind(pair, roles, adapter_name)
    if "down" in roles or "up" in roles:
        if not {"down", "up"} <= roles:
            have = pair.keys.get("down") or pair.keys.get("up")
            missing = "lora_B/lora_up" if "up" not in roles else "lora_A/lora_down"
            raise KeyMatchError(f"{adapter_name}: {have!r} has no {missing} partner")
        if "diff" in roles:
            raise KeyMatchError(f"{adapter_name}: module {name!r} has both LoRA factors and a "
                                "full-weight diff")
        if {"magnitude", "dora_scale"} <= roles:
            raise KeyMatchError(f"{adapter_name}: module {name!r} has two DoRA magnitudes")
        return "lora"
    if "diff" in roles:
        extra = roles - {"diff", "diff_b"}
        if extra:
            raise KeyMatchError(f"{adapter_name}: module {name!r}: {sorted(extra)} beside a "
                                "full-weight diff")
        return "diff"
    if roles == {"diff_b"}:
        return "bias"
    lonely = sorted(roles)[0]
    what = {"alpha": "alpha", "magnitude": "DoRA magnitude", "dora_scale": "DoRA scale",
            "up_bias": "LoRA bias"}.get(lonely, lonely)
    raise KeyMatchError(f"{adapter_name}: {what} {pair.keys[lonely]!r} has no lora factors "
                        "beside it")


def match(adapter_keys, model_keys, adapter_name="adapter"):
    """Pair the adapter's keys by module, settle each module's kind, and find its model keys.

    Raises KeyMatchError for an incomplete pair, a lone alpha or magnitude, an adapter kind
    that is not fused (naming the kind and a tensor), or an adapter in which nothing matches a
    weight."""
    index = ModelIndex(model_keys)
    modules, unused = {}, []
    for key in adapter_keys:
        module, suffix = split_key(key)
        if module is None:
            unused.append(key)
            continue
        if suffix in REFUSED:
            raise KeyMatchError(f"{adapter_name}: {key!r} belongs to {REFUSED[suffix]} "
                                "adapter, which ltx2blas does not fuse")
        role = ROLES[suffix]
        pair = modules.setdefault(module, Pair(module=module))
        if role in pair.keys:
            raise KeyMatchError(f"{adapter_name}: two {role} tensors for module {module!r} "
                                f"({pair.keys[role]!r} and {key!r})")
        pair.keys[role] = key

    result = AdapterMatch()
    for key in unused:
        (result.extra if _own_module(key, index) else result.unused).append(key)
    by_target = {}
    for name, pair in modules.items():
        pair.kind = _kind(pair, adapter_name)
        stripped, prefix = strip_prefix(name)
        found = index.find(stripped, adapter_name)
        if found is not None:
            pair.target = index.weights[found]
            if {"up_bias", "diff_b"} & set(pair.keys):
                bias = pair.target[: -len(".weight")] + ".bias"
                pair.bias_target = bias if bias in index.biases else None
        if found is None:
            pair.component = component(stripped)
            result.unmatched.append(pair)
        else:
            _refuse_second_spelling(by_target.setdefault(pair.target, pair), pair, adapter_name)
            result.pairs.append(pair)
    if not result.pairs:
        sample = ", ".join(sorted(modules)[:3]) or ", ".join(sorted(unused)[:3]) or "(none)"
        raise KeyMatchError(f"{adapter_name}: matches no weight of the model (adapter modules "
                            f"such as {sample}); allow_unmatched=True cannot help, as it fuses "
                            "the modules that match and none does: is this the model the "
                            "adapter was made for?")
    return result


def _refuse_second_spelling(first, pair, adapter_name):
    """KeyMatchError where ``pair`` is a second module of one file naming the weight that
    ``first`` names (diffusion_model.X.lora_A beside lora_unet_X.lora_down): a loader that
    takes every key would add the adapter to that weight twice, and which spelling was meant
    cannot be told from the file."""
    if first is pair:
        return

    def key(p):
        return next(iter(p.keys.values()))
    raise KeyMatchError(f"{adapter_name}: {key(first)!r} and {key(pair)!r} name the same weight "
                        f"{pair.target} in two spellings (modules {first.module!r} and "
                        f"{pair.module!r}); fusing both would add it twice, so nothing is fused: "
                        "keep one spelling of each module")


def _own_module(key, index):
    """Whether a key of no adapter role is a tensor of a module of the adapter's own -- a
    dotted name no part of which is a module of the model (an IC-LoRA's
    reference_slot_embedding.net.0.weight) -- rather than something said of a model's module
    (a full weight, a role ltx2blas does not know)."""
    name, _ = strip_prefix(key)
    parts = name.split(".")
    if len(parts) < 2:
        return False
    return not any(_is_model_module(".".join(parts[:n]), index) for n in range(1, len(parts) + 1))


def _is_model_module(name, index):
    try:
        return index.find(name, "") is not None
    except KeyMatchError:  # a name several of the model's modules answer to
        return True
