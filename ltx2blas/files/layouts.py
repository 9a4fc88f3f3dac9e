"""Which stored layout a checkpoint's weight is in, read from the tensors beside it.

A module's weight ``<m>.weight`` is plain when nothing quantises it (BF16, or F8_E4M3/F8_E5M2
cast codes) and otherwise takes the layout its companions say:

=============  ==========================================================================
``fp8_scaled``  F8_E4M3 weight with an F32 one-value ``<m>.weight_scale`` (LTX-2.3's fp8
                checkpoints; upstream's fp8_scaled_mm policy).  ``<m>.input_scale`` is kept.
``fp8_block``   F8_E4M3 weight [out, in] with an F32 ``<m>.weight_scale`` [out/128, in/128].
``fp6_block``   U8 packed fp6 [out, in*3/4] with an F32 ``<m>.weight_scale`` [out/128, in/128].
``nvfp4``       U8 packed E2M1 [out, in/2], ``<m>.weight_scale`` E4M3 (or U8) block scales in
                the cuBLAS tiled layout, F32 one-value ``<m>.weight_scale_2``.
``comfy_fp8``   ComfyUI's scaled fp8: a ``<m>.comfy_quant`` tensor (JSON bytes) or an entry of
                the ``_quantization_metadata`` metadata naming format ``float8_e4m3fn`` or
                ``float8_e5m2``, with ``<m>.weight_scale``; or the older layout marked by a
                ``scaled_fp8`` tensor, with ``<m>.scale_weight``.
``comfy_nvfp4`` ComfyUI's ``nvfp4``: stored as ``nvfp4`` (U8 packed, ``weight_scale`` E4M3 or
                U8 block scales, tiled; ``weight_scale_2`` one F32 value).
``comfy_mxfp8`` ComfyUI's ``mxfp8``: F8_E4M3 [out, in], ``weight_scale`` F8_E8M0 (or U8)
                exponents of 32 elements in the tiled layout.
``comfy_int8``  ComfyUI's ``int8_tensorwise``: I8 [out, in], ``weight_scale`` one F32 value
                (shape []) or one per row ([out, 1]).
=============  ==========================================================================

Anything else that carries a scale, a ComfyUI format not among these (``convrot_w4a4``,
``awq_w4a16``, ..., and ``int8_tensorwise`` with its ``convrot`` rotation), or a layer with an
AWQ ``pre_quant_scale`` (its weight is not the layer's), is refused with a DTypeError naming
the tensor and the format, before anything is written (a marker that cannot be read at all is
a FormatError).  ComfyUI pads nvfp4 and mxfp8 weights to whole blocks of 16 and 32; the shape
an adapter must fit is the stored one.
"""
import math
from dataclasses import dataclass

from .._validate import FP8, FP8_BY_NAME
from ..errors import DTypeError, FormatError, ShapeError
from ..quantized import tiled_shape
from .safetensors import parse_json

PLAIN = {"BF16": "bf16", "F8_E4M3": "F8_E4M3", "F8_E5M2": "F8_E5M2"}
COMPANIONS = (".weight_scale", ".weight_scale_2", ".scale_weight", ".comfy_quant")
#: ComfyUI's format names (its comfy_quant markers) -> the layouts that fuse them.
COMFY_FORMATS = {"float8_e4m3fn": "comfy_fp8", "float8_e5m2": "comfy_fp8",
                 "nvfp4": "comfy_nvfp4", "mxfp8": "comfy_mxfp8", "int8_tensorwise": "comfy_int8"}


@dataclass(frozen=True)
class Layout:
    """How one weight is stored and fused."""
    kind: str            # "bf16", "fp8" (cast codes) or a quantized.LAYOUTS name
    fmt: str             # the codes' format: "bf16", "F8_E4M3", "F8_E5M2", "int8" or "packed"
    shape: tuple         # the logical [out, in] an adapter must fit
    scale: str = None    # the tensor names of the scales the rule rewrites
    scale_2: str = None

    @property
    def quantized(self):
        return self.kind not in ("bf16", "fp8")

    @property
    def rewritten(self):
        """The companion tensors written anew with the weight."""
        return tuple(n for n in (self.scale, self.scale_2) if n)


def module_of(key):
    return key[: -len(".weight")] if key.endswith(".weight") else None


def comfy_configs(metadata, entries, read_bytes):
    """{module: config} from ComfyUI's markers: ``<m>.comfy_quant`` tensors (``read_bytes(name)``
    gives their bytes) and the ``_quantization_metadata`` metadata entry.  Also whether the
    older ``scaled_fp8`` marker tensor is present."""
    configs = {}
    raw = (metadata or {}).get("_quantization_metadata")
    if raw is not None:
        def fail(message):
            raise FormatError(f"__metadata__ _quantization_metadata {message}")

        data = parse_json(raw, fail, "(ComfyUI's {\"layers\": {...}})")
        layers = data.get("layers") if isinstance(data, dict) else None
        if not isinstance(layers, dict):
            fail("is not ComfyUI's {\"layers\": {...}} JSON")
        for name, conf in layers.items():
            configs[name] = conf
    for name, (dtype, shape) in entries.items():
        if name.endswith(".comfy_quant"):
            if dtype != "U8" or len(shape) != 1:
                raise FormatError(f"tensor {name!r}: a comfy_quant marker is U8 JSON bytes, got "
                                  f"{dtype} {list(shape)}")
            def unreadable(message, name=name):
                raise FormatError(f"tensor {name!r} {message}")

            try:
                configs[name[: -len(".comfy_quant")]] = parse_json(
                    bytes(read_bytes(name)).decode("utf-8"), unreadable, "(a comfy_quant marker)")
            except (FormatError, UnicodeDecodeError) as exc:
                # raised if the weight beside it is fused: a weight no adapter touches is copied
                configs[name[: -len(".comfy_quant")]] = exc if isinstance(
                    exc, FormatError) else FormatError(f"tensor {name!r} is not JSON ({exc})")
    marker = any(n == "scaled_fp8" or n.endswith(".scaled_fp8") for n in entries)
    return configs, marker


def _one_f32(entries, name, key):
    dtype, shape = entries[name]
    if dtype != "F32" or math.prod(shape) != 1:
        raise DTypeError(f"weight {key}: {name} is {dtype} {list(shape)}; a per-tensor scale is "
                          "one F32 value")


def detect(key, entries, configs, marker):
    """The Layout of weight ``key``; ``entries`` maps every tensor name to (dtype, shape)."""
    dtype, shape = entries[key]
    module = module_of(key)
    has = {s: (module + s) in entries for s in COMPANIONS} if module else {}
    conf = _comfy_conf(module, configs)
    if len(shape) != 2:
        raise ShapeError(f"weight {key} has shape {list(shape)}; LoRA fuses into 2-D weights")
    rows, cols = shape
    refuse = f"weight {key} ({dtype} {list(shape)})"
    if conf is not None or (marker and has.get(".scale_weight")):
        if conf is None:  # the older layout: the weight's own fp8 dtype says the format
            fmt_name = FP8[dtype].name if dtype in FP8 else None
        elif not isinstance(conf, dict):
            raise DTypeError(f"{refuse}: its ComfyUI quantisation config is a JSON "
                             f"{type(conf).__name__}, not an object with a \"format\"")
        elif "format" not in conf:
            raise DTypeError(f"{refuse}: its ComfyUI quantisation config has no \"format\" key")
        else:
            fmt_name = conf["format"]
            if not isinstance(fmt_name, str):
                raise DTypeError(f"{refuse}: its ComfyUI quantisation config's \"format\" is a "
                                 f"JSON {type(fmt_name).__name__}, not a format's name")
        if fmt_name not in COMFY_FORMATS:
            raise DTypeError(f"{refuse}: ComfyUI quantisation format {fmt_name!r} is not one "
                             f"ltx2blas fuses ({', '.join(COMFY_FORMATS)})")
        if module + ".pre_quant_scale" in entries:
            raise DTypeError(f"{refuse}: {module}.pre_quant_scale (AWQ smoothing) scales the "
                             "layer's input, so its stored weight is not the layer's; not fused")
        if fmt_name not in FP8_BY_NAME:
            return _comfy_layout(key, fmt_name, conf, entries, module, dtype, rows, cols, refuse)
        fmt = FP8_BY_NAME[fmt_name]
        if dtype != fmt:
            raise DTypeError(f"{refuse}: ComfyUI says {fmt_name} but the weight is {dtype}")
        scale = module + (".weight_scale" if has[".weight_scale"] else ".scale_weight")
        if scale not in entries:
            raise DTypeError(f"{refuse}: ComfyUI fp8 without its weight_scale / scale_weight")
        _one_f32(entries, scale, key)
        return Layout("comfy_fp8", fmt, (rows, cols), scale)
    if module and has[".scale_weight"]:
        raise DTypeError(f"{refuse}: {module}.scale_weight without ComfyUI's scaled_fp8 marker "
                          "tensor; layout not handled")
    if module and has[".weight_scale_2"]:
        scale, scale_2 = module + ".weight_scale", module + ".weight_scale_2"
        if dtype != "U8" or scale not in entries:
            raise DTypeError(f"{refuse}: weight_scale_2 marks NVFP4, which stores U8 codes "
                              "with a weight_scale")
        s_dtype, s_shape = entries[scale]
        logical = (rows, cols * 2)
        want = (-(-rows // 128) * 128, -(-(logical[1] // 16) // 4) * 4)
        if s_dtype not in ("F8_E4M3", "U8") or tuple(s_shape) != want:
            raise DTypeError(f"{refuse}: NVFP4 block scales {scale} are {s_dtype} {list(s_shape)}; "
                              f"expected F8_E4M3 {list(want)} (the cuBLAS tiled layout)")
        _one_f32(entries, scale_2, key)
        return Layout("nvfp4", "packed", logical, scale, scale_2)
    if module and has[".weight_scale"]:
        scale = module + ".weight_scale"
        s_dtype, s_shape = entries[scale]
        if dtype == "F8_E4M3" and s_dtype == "F32" and math.prod(s_shape) == 1:
            return Layout("fp8_scaled", "F8_E4M3", (rows, cols), scale)
        if dtype == "F8_E4M3" and s_dtype == "F32" and tuple(s_shape) == (rows / 128, cols / 128):
            return Layout("fp8_block", "F8_E4M3", (rows, cols), scale)
        if dtype == "U8" and cols % 3 == 0 and s_dtype == "F32" and \
                tuple(s_shape) == (rows / 128, cols * 4 / 3 / 128):
            return Layout("fp6_block", "packed", (rows, cols * 4 // 3), scale)
        raise DTypeError(f"{refuse}: its weight_scale is {s_dtype} {list(s_shape)}, which is no "
                          "layout ltx2blas fuses (per-tensor fp8, blockwise fp8/fp6, NVFP4)")
    if dtype not in PLAIN:
        raise DTypeError(f"weight {key} is {dtype}; ltx2blas fuses into BF16, F8_E4M3 and "
                         "F8_E5M2 weights and the scaled layouts of ltx2blas.quantized")
    return Layout("bf16" if dtype == "BF16" else "fp8", PLAIN[dtype], (rows, cols))


def _comfy_layout(key, fmt_name, conf, entries, module, dtype, rows, cols, refuse):
    """The Layout of a weight ComfyUI marks nvfp4, mxfp8 or int8_tensorwise."""
    layout = COMFY_FORMATS[fmt_name]
    scale = module + ".weight_scale"
    if scale not in entries:
        raise DTypeError(f"{refuse}: ComfyUI {fmt_name} without its {scale}")
    s_dtype, s_shape = entries[scale]
    stored = {"comfy_nvfp4": "U8", "comfy_mxfp8": "F8_E4M3", "comfy_int8": "I8"}[layout]
    if dtype != stored:
        raise DTypeError(f"{refuse}: ComfyUI says {fmt_name}, whose weight is {stored}")
    if layout == "comfy_int8":
        if isinstance(conf, dict) and conf.get("convrot"):
            raise DTypeError(f"{refuse}: ComfyUI int8_tensorwise with its convrot rotation, which "
                             "ltx2blas does not fuse")
        if s_dtype != "F32" or tuple(s_shape) not in ((), (rows, 1)):
            raise DTypeError(f"{refuse}: its {scale} is {s_dtype} {list(s_shape)}; ComfyUI's "
                             f"int8_tensorwise scale is F32 [] or one per row, [{rows}, 1]" +
                             (" (a [1] scale ComfyUI would rewrite as one per row, another shape)"
                              if math.prod(s_shape) == 1 else ""))
        return Layout(layout, "int8", (rows, cols), scale)
    logical = (rows, cols * 2) if layout == "comfy_nvfp4" else (rows, cols)
    group = 16 if layout == "comfy_nvfp4" else 32
    want = tiled_shape(layout, *logical) if logical[1] % group == 0 else None
    kinds = ("F8_E4M3", "U8") if layout == "comfy_nvfp4" else ("F8_E8M0", "U8")
    if s_dtype not in kinds or want is None or tuple(s_shape) != want:
        raise DTypeError(f"{refuse}: ComfyUI {fmt_name} block scales {scale} are {s_dtype} "
                         f"{list(s_shape)}; expected {kinds[0]} "
                         f"{list(want) if want else f'(columns in blocks of {group})'} (the cuBLAS "
                         "tiled layout)")
    if layout == "comfy_mxfp8":
        return Layout(layout, "F8_E4M3", logical, scale)
    scale_2 = module + ".weight_scale_2"
    if scale_2 not in entries:
        raise DTypeError(f"{refuse}: ComfyUI nvfp4 without its {scale_2}")
    _one_f32(entries, scale_2, key)
    return Layout(layout, "packed", logical, scale, scale_2)


def _comfy_conf(module, configs):
    conf = None
    if module is not None and module in configs:
        conf = configs[module]
    elif module is not None:
        for prefix in ("model.diffusion_model.", "diffusion_model."):
            if module.startswith(prefix) and module[len(prefix):] in configs:
                conf = configs[module[len(prefix):]]
                break
    if isinstance(conf, Exception):
        raise conf
    return conf


def output_order(names, layouts):
    """The checkpoint's tensor names in file order, with every rewritten companion moved to
    just after its weight (it is written from memory once the weight is fused)."""
    moved = {c for lay in layouts.values() for c in lay.rewritten}
    order = []
    for name in names:
        if name in moved:
            continue
        order.append(name)
        if name in layouts:
            order.extend(layouts[name].rewritten)
    return order
