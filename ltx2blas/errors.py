"""One exception hierarchy, so callers can catch by kind.

Every class derives from :class:`Ltx2BlasError` and from the built-in exception a caller would
already expect (``ValueError`` for bad values and shapes, ``TypeError`` for wrong dtypes,
``OSError`` for files), so ``except ValueError`` keeps working.
"""


class Ltx2BlasError(Exception):
    """Base class of every error ltx2blas raises on purpose."""


class ArgumentError(Ltx2BlasError, ValueError):
    """An argument of the wrong value: an unknown option name, a count out of range, an output
    that is an input."""


class ArgumentTypeError(Ltx2BlasError, TypeError):
    """An argument of the wrong type (a string where a number or a sequence belongs)."""


class ShapeError(Ltx2BlasError, ValueError):
    """Array shapes or ranks that do not fit together."""


class DTypeError(Ltx2BlasError, TypeError):
    """An array of a dtype the operation does not take (never silently converted)."""


class LayoutError(Ltx2BlasError, ValueError):
    """An array whose memory layout the operation cannot use (strides, read-only, overlap)."""


class FormatError(Ltx2BlasError, ValueError):
    """A file that is not a valid safetensors file (or index): the message names the file and
    the field at fault."""


class Ltx2IOError(Ltx2BlasError, OSError):
    """Reading or writing a file failed (missing, not a regular file, truncated, disk full)."""


class KeyMatchError(Ltx2BlasError, ValueError):
    """Adapter keys that cannot be used: a lora_A without its lora_B, an alpha without a pair,
    an adapter file that matches no weight at all."""


class AlreadyFusedError(Ltx2BlasError, ValueError):
    """The checkpoint's metadata says an adapter is already fused into it."""


class NumericsError(Ltx2BlasError, ValueError):
    """Non-finite values where finite ones are required.

    Where an adapter's tensor is at fault, ``adapter`` is its position in the call's adapters
    and ``tensor`` which of its tensors ("lora_a", "lora_b", "diff"), so that a caller that
    knows their names (the file layer: a file and a key) can say them."""

    def __init__(self, message, *, adapter=None, tensor=None):
        super().__init__(message)
        self.adapter, self.tensor = adapter, tensor


class NonFiniteInputError(NumericsError):
    """An adapter tensor or scale holds inf or NaN."""


class NonFiniteWeightError(NumericsError):
    """The base weight already holds inf or NaN before anything is fused into it."""


class NonFiniteResultError(NumericsError):
    """A fused value overflowed to inf (or became NaN) when rounded to the storage dtype."""


def printable(text):
    """``text`` with every character a terminal acts on instead of showing (control characters,
    line and paragraph separators, bidirectional controls) written as its Python escape, so
    that a name read from a file cannot move the cursor, clear the screen or start a line."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def counted(n, one, many=None):
    """``n`` and the noun, singular for one ("1 module", "2 modules", "3 biases"): the one
    rule every message that counts follows."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def listed(items):
    """Items as a sentence lists them: "a", "a and b", "a, b and c"."""
    items = list(items)
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)
