"""PEFT's ``rank_pattern`` / ``alpha_pattern`` keys, matched as PEFT matches them but in time
that no file can make grow faster than the names it is matched against.

PEFT takes the first key, in the file's order, for which ``re.match(rf"(.*\\.)?({key})$",
name)`` succeeds.  Python's ``re`` backtracks, so a key such as ``(.|.)*Z`` takes exponential
time, and a table past ``re``'s cache compiles again on every match.  Here:

* a key made only of letters, digits, ``_`` and ``-`` (a module name's words) or of such words
  joined by dots (what diffusers writes) is a *fragment*: found in a dictionary by the name's
  dot-started suffixes, so a table of any size costs one look-up per suffix.  A fragment's
  dots match dots; PEFT's regular expression would let one match any character too, which
  differs only where a name has another character where the key has a dot;
* every other key is compiled once, with PEFT's wrapping, into a small automaton and run over
  the name by keeping the set of live states (Thompson's construction): at most
  ``len(name) x states`` steps for any key.  Back-references, look-arounds, inline flags and
  the like, which PEFT's wrapping cannot take or an automaton cannot run, are refused naming
  the key, as are automata past MAX_STATES states;
* the matching work of one table over all names is held to MAX_STEPS steps; past it the
  table is refused, naming it, instead of running for minutes.
"""
import re
import unicodedata

try:  # the parser behind ``re``: the same syntax, parsed as ``re`` parses it
    import re._parser as _parser
    import re._constants as _c
except ImportError:  # Python 3.10
    import sre_parse as _parser
    import sre_constants as _c

#: The most states one key's automaton may have (each ``{m,n}`` repetition is copied out).
MAX_STATES = 2000
#: The most (character x live state) steps one table may take over all the names of a file.
MAX_STEPS = 20_000_000
#: How deeply a key may nest groups (Python's parser recurses once per level).
MAX_NESTING = 100

_FRAGMENT = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")
_PLAIN_FLAGS = _parser.parse("a").state.flags


class PatternError(ValueError):
    """A key this module will not match; the message says why."""


class PatternTable:
    """One ``rank_pattern`` or ``alpha_pattern`` table: ``first(name)`` is the first key (in
    the table's order) that matches ``name``, or None."""

    def __init__(self, keys):
        self.keys = list(keys)
        self.fragments = {}   # fragment -> its first index
        self.automata = []    # (index, _Automaton) in the table's order
        for index, key in enumerate(self.keys):
            if not isinstance(key, str):
                raise PatternError(f"key {key!r} is not a string")
            if _FRAGMENT.fullmatch(key):
                self.fragments.setdefault(key, index)
            else:
                self.automata.append((index, _Automaton(key)))
        self.steps = 0

    def first(self, name):
        best = None
        start = 0
        # PEFT's ``.*`` does not cross a newline, and its ``$`` also holds before a final one
        words = name[:-1] if name.endswith("\n") else name
        if "\n" in words:
            words = ""
        while words:  # the name itself and each suffix that starts after a dot
            hit = self.fragments.get(words[start:])
            if hit is not None and (best is None or hit < best):
                best = hit
            dot = words.find(".", start)
            if dot < 0:
                break
            start = dot + 1
        for index, automaton in self.automata:
            if best is not None and index > best:
                break
            if automaton.matches(name, self):
                best = index
                break
        return None if best is None else self.keys[best]

    def spend(self, steps):
        """Counts matching work against MAX_STEPS."""
        self.steps += steps
        if self.steps > MAX_STEPS:
            raise PatternError(f"matching its {len(self.automata)} regular expressions against "
                               f"the module names takes more than {MAX_STEPS} steps")


# ---- the automata ---------------------------------------------------------------------------

_REFUSED = {"GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE", "GROUPREF_LOC_IGNORE",
            "GROUPREF_UNI_IGNORE", "ASSERT", "ASSERT_NOT", "ATOMIC_GROUP", "POSSESSIVE_REPEAT",
            "CALL", "CHARSET", "BIGCHARSET"}


def _digit(ch):
    return unicodedata.category(ch) == "Nd"


def _word(ch):
    return ch.isalnum() or ch == "_"


_CATEGORIES = {
    "CATEGORY_DIGIT": _digit, "CATEGORY_NOT_DIGIT": lambda ch: not _digit(ch),
    "CATEGORY_WORD": _word, "CATEGORY_NOT_WORD": lambda ch: not _word(ch),
    "CATEGORY_SPACE": str.isspace, "CATEGORY_NOT_SPACE": lambda ch: not ch.isspace(),
}


class _Automaton:
    """A key wrapped as PEFT wraps it, as a list of states: ("char", test, next), ("split",
    a, b), ("begin", next) (only at the start), ("end", next) (at the end, or before a final
    newline, as ``$``), ("match",)."""

    def __init__(self, key):
        if key.count("(") > MAX_NESTING:
            raise PatternError(f"{_short(key)} has more than {MAX_NESTING} groups")
        try:
            parsed = _parser.parse(rf"(.*\.)?({key})$")
        except (re.error, OverflowError, RecursionError) as exc:
            raise PatternError(f"{_short(key)} is not a regular expression PEFT can match "
                               f"({type(exc).__name__}: {exc})") from None
        if parsed.state.flags != _PLAIN_FLAGS:
            raise PatternError(f"{_short(key)} sets inline flags, which PEFT's wrapping of it "
                               "does not allow")
        self.key = key
        self.tail = _literal_tail(key)
        self.states = []
        self.match = self._state(("match",))
        self.start = self._sequence(list(parsed), self.match)
        self._closures = {}

    # construction: each piece is built back to front, given the state that follows it
    def _state(self, state):
        if len(self.states) >= MAX_STATES:
            raise PatternError(f"{_short(self.key)} needs more than {MAX_STATES} states")
        self.states.append(state)
        return len(self.states) - 1

    def _sequence(self, items, follow):
        for op, arg in reversed(items):
            follow = self._item(str(op), arg, follow)
        return follow

    def _item(self, op, arg, follow):
        if op in _REFUSED:
            raise PatternError(f"{_short(self.key)} uses {op.lower().replace('_', ' ')}, "
                               "which is refused")
        if op in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            return self._state(("char", _test(op, arg), follow))
        if op == "AT":
            where = str(arg)
            if where in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
                return self._state(("begin", follow))
            if where in ("AT_END", "AT_END_STRING"):
                return self._state(("end" if where == "AT_END" else "end_string", follow))
            raise PatternError(f"{_short(self.key)} uses {where.lower()}, which is refused")
        if op == "SUBPATTERN":
            _group, add_flags, del_flags, body = arg
            if add_flags or del_flags:
                raise PatternError(f"{_short(self.key)} sets inline flags, which is refused")
            return self._sequence(list(body), follow)
        if op == "BRANCH":
            _, branches = arg
            starts = [self._sequence(list(b), follow) for b in branches]
            entry = starts[-1]
            for s in reversed(starts[:-1]):
                entry = self._state(("split", s, entry))
            return entry
        if op in ("MAX_REPEAT", "MIN_REPEAT"):
            low, high, body = arg
            body = list(body)
            unbounded = high == _c.MAXREPEAT
            if low > MAX_STATES or (not unbounded and high > MAX_STATES):
                raise PatternError(f"{_short(self.key)} repeats a piece more than "
                                   f"{MAX_STATES} times")
            if unbounded:   # body*: a loop whose exit is the follow state
                loop = self._state(("split", None, follow))
                entry = self._sequence(body, loop)
                self.states[loop] = ("split", entry, follow)
                tail = loop
            else:           # (body(body(...)?)?)?: each optional copy may end the repetition
                tail = follow
                for _ in range(high - low):
                    tail = self._state(("split", self._sequence(body, tail), follow))
            for _ in range(low):
                tail = self._sequence(body, tail)
            return tail
        raise PatternError(f"{_short(self.key)} uses {op.lower()}, which is refused")

    # running
    def _closure(self, pc, at_start, at_end):
        """The states reachable from pc without reading: char states and the match."""
        memo_key = (pc, at_start, at_end)
        if memo_key in self._closures:
            return self._closures[memo_key]
        out, seen, stack = [], set(), [pc]
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            state = self.states[p]
            kind = state[0]
            if kind in ("char", "match"):
                out.append(p)
            elif kind == "split":
                stack.extend((state[2], state[1]))
            elif kind == "begin" and at_start:
                stack.append(state[1])
            elif kind in ("end", "end_string") and at_end[kind == "end_string"]:
                stack.append(state[1])
        out = tuple(out)
        self._closures[memo_key] = out
        return out

    def matches(self, name, budget):
        if not (name.endswith(self.tail) or name.endswith(self.tail + "\n")):
            return False  # every match ends in the key's last literal characters
        n = len(name)

        def ends(pos):   # (``$`` holds, ``\Z`` holds) at pos
            return (pos == n or (pos == n - 1 and name[-1] == "\n"), pos == n)

        live = set(self._closure(self.start, True, ends(0)))
        for pos, ch in enumerate(name):
            # re.match: a match that ends before the name's end counts (a key can close
            # PEFT's group and leave its ``$`` behind an alternation)
            if not live or self.match in live:
                return bool(live)
            budget.spend(len(live))
            after = ends(pos + 1)
            nxt = set()
            for p in live:
                state = self.states[p]
                if state[0] == "char" and state[1](ch):
                    nxt.update(self._closure(state[2], False, after))
            live = nxt
        return self.match in live


def _test(op, arg):
    """The character test of a LITERAL, NOT_LITERAL, ANY (no newline, as ``re`` without
    DOTALL) or IN item."""
    if op == "LITERAL":
        ch = chr(arg)
        return lambda c: c == ch
    if op == "NOT_LITERAL":
        ch = chr(arg)
        return lambda c: c != ch
    if op == "ANY":
        return lambda c: c != "\n"
    negate = False
    tests = []
    for kind, value in arg:
        kind = str(kind)
        if kind == "NEGATE":
            negate = True
        elif kind == "LITERAL":
            tests.append(lambda c, ch=chr(value): c == ch)
        elif kind == "RANGE":
            tests.append(lambda c, lo=value[0], hi=value[1]: lo <= ord(c) <= hi)
        elif kind == "CATEGORY" and str(value) in _CATEGORIES:
            tests.append(_CATEGORIES[str(value)])
        else:
            raise PatternError(f"a character class uses {kind.lower()}, which is refused")
    if negate:
        return lambda c: not any(t(c) for t in tests)
    return lambda c: any(t(c) for t in tests)


def _literal_tail(key):
    """The literal characters every match of ``key`` ends with ("" where it may end in
    anything: a top-level alternation, a class, a repetition)."""
    try:
        items = list(_parser.parse(key))
    except (re.error, OverflowError, RecursionError):
        return ""
    while items and str(items[-1][0]) == "AT" and str(items[-1][1]) in ("AT_END",
                                                                          "AT_END_STRING"):
        items.pop()
    tail = []
    for op, arg in reversed(items):
        if str(op) != "LITERAL":
            break
        tail.append(chr(arg))
    return "".join(reversed(tail))


def _short(key, most=60):
    text = repr(key)
    return f"key {text[:most]}...{text[-1]}" if len(text) > most else f"key {text}"
