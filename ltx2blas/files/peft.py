"""PEFT's LoRA configuration as diffusers saves it beside an adapter's tensors, and the scale it
gives each module.

diffusers writes ``LoraConfig.to_dict()`` as JSON in the safetensors metadata under
``lora_adapter_metadata``: one flat object whose keys are ``<component>.<field>``
(``transformer.r``, ``transformer.lora_alpha``, ...; without the component when a model saved
its own adapter), the fields that PEFT reads to build each LoRA layer.  There is no ``.alpha``
tensor in such a file, and diffusers and PEFT scale a module's product by

    (strength * alpha_m) / r_m        (use_rslora: (strength * alpha_m) / sqrt(r_m))

with ``r_m`` the first ``rank_pattern`` key that matches the module's name, else ``r``, and
``alpha_m`` likewise from ``alpha_pattern``, else ``lora_alpha`` (PEFT >= 0.15's matching: a key
is a regular expression that must match the whole name or a suffix of it that starts after a
dot; matched here in bounded time, :mod:`ltx2blas.files.patterns`).  Fields absent from the
JSON take PEFT's defaults (r 8, lora_alpha 8).  Fields that make PEFT compute something other
than a LoRA or DoRA (another initialisation that rewrites the base weight, the LoRA variants)
are refused, and so is a configuration the tensors contradict.  Fields of other components
(``text_encoder.r``, ...) are left unread, as diffusers reads a component's fields only when
it loads that component.
"""
import math
from dataclasses import dataclass, field

from ..errors import FormatError
from .patterns import PatternError, PatternTable
from .safetensors import parse_json

METADATA_KEY = "lora_adapter_metadata"
#: The components diffusers' LTX-2 pipeline saves and loads adapters for.
COMPONENTS = ("transformer", "connectors")
#: PEFT's LoraConfig defaults for the fields read here.
DEFAULTS = {"r": 8, "lora_alpha": 8, "use_rslora": False, "use_dora": False, "lora_bias": False,
            "rank_pattern": {}, "alpha_pattern": {}}
#: Fields whose values change what PEFT computes from the same tensors (a variant of LoRA), or
#: change the base weight when the adapter is loaded; each is fused only at its default.
VARIANTS = ("use_bdlora", "arrow_config", "alora_invocation_tokens", "velora_config",
            "monteclora_config", "kasa_config", "layer_replication")
#: init_lora_weights values that rewrite the base weight as the adapter loads, or pick a variant.
REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "mica")
#: The largest rank or alpha taken: beyond any real adapter, and exact as a double.
LARGEST = 2**53


@dataclass
class LoraConfig:
    """One component's configuration: the fields that set a module's rank and scale."""
    component: str
    r: int
    lora_alpha: float
    use_rslora: bool
    use_dora: bool
    lora_bias: bool
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    path: str = ""
    tables: dict = field(default_factory=dict, repr=False)   # field name -> PatternTable

    def rank_and_alpha(self, name):
        """(r_m, alpha_m) of the module ``name`` (relative to the component)."""
        return (self._pattern("rank_pattern", name, self.r),
                self._pattern("alpha_pattern", name, self.lora_alpha))

    def _pattern(self, which, name, default):
        table = self.tables.get(which)
        if table is None:
            return default
        try:
            key = table.first(name)
        except PatternError as exc:
            where = f"{self.component}." if self.component else ""
            raise FormatError(f"{self.path}: __metadata__ {METADATA_KEY}: {where}{which}: "
                              f"{exc}") from None
        return default if key is None else getattr(self, which)[key]

    def scale(self, strength, rank, alpha):
        """PEFT's scaling of a module at adapter weight ``strength``: (w * alpha) / r, or over
        sqrt(r) with rsLoRA, in Python's double arithmetic, in PEFT's order."""
        return strength * alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def describe(self):
        patterns = ""
        if self.rank_pattern or self.alpha_pattern:
            patterns = (f", {len(self.rank_pattern)} rank_pattern and {len(self.alpha_pattern)} "
                        "alpha_pattern entries")
        return (f"{self.component or 'adapter'}: r {self.r}, lora_alpha {self.lora_alpha:g}"
                f"{', use_rslora' if self.use_rslora else ''}{patterns}")


def read_configs(metadata, path):
    """({component (or "" when unprefixed): LoraConfig}, [components whose fields were left
    unread]) from a file's metadata; ({}, []) when it holds no lora_adapter_metadata.
    FormatError for JSON that is not PEFT's configuration."""
    raw = (metadata or {}).get(METADATA_KEY)
    if raw is None:
        return {}, []

    def fail(message):
        raise FormatError(f"{path}: __metadata__ {METADATA_KEY}: {message}")

    data = parse_json(raw, fail, "the value")
    if not isinstance(data, dict):
        fail(f"is a JSON {type(data).__name__}, not PEFT's configuration (an object)")
    # A field of PEFT's LoraConfig has no dot in its name: a dotted key is a component's field
    # (diffusers' <component>.<field>), read for the components fused here and left alone for
    # the others, as diffusers leaves them when it loads the transformer.
    by_component, ignored = {}, []
    for key, value in data.items():
        component, dot, name = key.partition(".")
        if not dot:
            component, name = "", key
        elif component not in COMPONENTS:
            if component not in ignored:
                ignored.append(component)
            continue
        by_component.setdefault(component, {})[name] = value
    configs = {component: _config(component, fields, fail, path)
               for component, fields in by_component.items()}
    return configs, ignored


def component_names(configs):
    """The components a file's metadata configures, as messages name them."""
    return ", ".join(c or "(unprefixed fields)" for c in sorted(configs))


def _shown(value, most=40):
    text = repr(value)
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def _config(component, fields, fail, path):
    where = f"{component}." if component else ""
    values = {**DEFAULTS, **{k: v for k, v in fields.items() if k in DEFAULTS}}

    def number(name, value, integer=False):
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        # an int past LARGEST is refused before math.isfinite, which cannot take it
        if (not ok or isinstance(value, bool) or not (0 < value <= LARGEST)
                or not math.isfinite(value)):
            fail(f"{where}{name} is {_shown(value)}; PEFT takes a positive "
                 f"{'integer' if integer else 'number'} (ltx2blas: up to 2**53)")
        return value

    for name in ("use_rslora", "use_dora", "lora_bias"):
        if not isinstance(values[name], bool):
            fail(f"{where}{name} is {values[name]!r}, not true or false")
    for name in VARIANTS:
        if fields.get(name) not in (None, False, {}, []):
            fail(f"{where}{name} is {fields[name]!r}: a LoRA variant (or a change to the model's "
                 "layers) that ltx2blas does not fuse")
    init = fields.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(REWRITING_INITS):
        fail(f"{where}init_lora_weights is {init!r}, which makes PEFT rewrite the base weight as "
             "the adapter loads (or picks a LoRA variant); ltx2blas does not fuse it")
    patterns, tables = {}, {}
    for name in ("rank_pattern", "alpha_pattern"):
        table = values[name] if values[name] is not None else {}
        if not isinstance(table, dict):
            fail(f"{where}{name} is {_shown(table)}, not an object of patterns")
        for key, value in table.items():
            number(f"{name}[{_shown(key)}]", value, integer=name == "rank_pattern")
        try:  # each key compiled once, here
            tables[name] = PatternTable(table) if table else None
        except PatternError as exc:
            fail(f"{where}{name}: {exc}")
        patterns[name] = dict(table)
    return LoraConfig(component, number("r", values["r"], integer=True),
                      number("lora_alpha", values["lora_alpha"]), values["use_rslora"],
                      values["use_dora"], values["lora_bias"], **patterns, path=path,
                      tables={k: v for k, v in tables.items() if v is not None})


def config_of(configs, key, path):
    """(the LoraConfig an adapter key belongs to, its component's prefix) or (None, "") when
    the file has none.  A key names its component by its first name (``transformer.``,
    ``connectors.``, as diffusers saves them); a key without one (LTX-2's own names) takes the
    file's only configuration.  FormatError where diffusers could not load the file: a
    component the metadata does not configure, or a key that cannot tell between several."""
    if not configs:
        return None, ""
    first = key.partition(".")[0]
    if first in COMPONENTS:
        if first in configs:
            return configs[first], first + "."
        if "" not in configs:
            raise FormatError(f"{path}: {key!r} belongs to the {first}, which its "
                              f"{METADATA_KEY} does not configure (it has "
                              f"{component_names(configs)})")
    if len(configs) > 1:
        raise FormatError(f"{path}: {key!r} names no component, and its {METADATA_KEY} "
                          f"configures several ({component_names(configs)})")
    return next(iter(configs.values())), ""
