"""Java regular expressions (``java.util.regex.Pattern``) run by Python's ``re`` with Java's meaning.

Pure functions, no I/O; used by ``ssl.principal.mapping.rules`` (proxy.identity.ssl_principal).

Guarantees: ``JavaRegex(pattern).translate()`` returns a Python pattern, to compile with
``re.ASCII``, that matches what Java's pattern matches (ASCII ``\\w \\d \\s`` and case folding,
``\\b`` taking letters and digits of any script as word characters as JDK 17 does, Java's line
terminators for ``.``, ``^``, ``$``, ``\\Z``; ``\\Q..\\E``, ``(?<name>..)``, ``\\k<name>``, ``\\h``,
``\\v``, ``\\R``, ``\\e``, ``\\cX``, ``\\0oct``, ``\\x{h..}``, POSIX ``\\p{Alpha}``-style classes,
inline flags ``i d m s`` anywhere); it raises ``JavaSyntaxError`` where ``Pattern.compile`` throws,
and ``UnsupportedConstruct`` for what ``re`` cannot express the same way (class intersection
``&&`` or nesting, ``\\p{L}``-style Unicode properties, flags ``u U x``, ``\\G``, ``\\X``, back
references to a group not yet closed): never a pattern with another meaning.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["JAVA_DOT", "JAVA_END", "JavaRegex", "JavaSyntaxError", "UnsupportedConstruct"]

JAVA_DOT = r"[^\n\r\x85\u2028\u2029]"  # Java's '.' (no DOTALL, no UNIX_LINES): any char but a line terminator
# Java's '$' without MULTILINE: at the end, or before a line terminator ending the input (not inside \r\n).
JAVA_END = r"(?:\Z|(?=\r\n\Z)|(?=[\r\x85\u2028\u2029]\Z)|(?<!\r)(?=\n\Z))"


class JavaSyntaxError(Exception):
    """Java's Pattern.compile (or Matcher.appendReplacement) would throw this."""


class UnsupportedConstruct(Exception):
    """A Java construct that Python's re cannot express with the same meaning."""


_TERMINATORS = r"\n\r\x85\u2028\u2029"
_HORIZONTAL = r" \t\xa0\u1680\u180e\u2000-\u200a\u202f\u205f\u3000"  # Java's \h
_VERTICAL = r"\n\x0b\f\r\x85\u2028\u2029"  # Java's \v
_POSIX = {  # Java's US-ASCII POSIX classes, \p{Name}
    "Lower": "a-z",
    "Upper": "A-Z",
    "ASCII": r"\x00-\x7f",
    "Alpha": "a-zA-Z",
    "Digit": "0-9",
    "Alnum": "a-zA-Z0-9",
    "Punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    "Graph": "a-zA-Z0-9" + re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    "Print": "a-zA-Z0-9" + re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + r"\ ",
    "Blank": r"\ \t",
    "Cntrl": r"\x00-\x1f\x7f",
    "XDigit": "0-9a-fA-F",
    "Space": r"\ \t\n\x0b\f\r",
}
_NAME = re.compile(r"<([A-Za-z][A-Za-z0-9]*)>")
_FLAGS = re.compile(r"([idmsuxU]*)(?:-([idmsuxU]*))?([:)])")
_REPETITION = re.compile(r"\{([0-9]+)(?:,([0-9]*))?\}")
_HEX = frozenset("0123456789abcdefABCDEF")
_OCTAL = frozenset("01234567")


class _Level:
    """An open group: the flags to restore at its end, its number if capturing, and the (?i:/(?-i:
    wrappers opened inside it for inline flags, which `|` and `)` must close."""

    __slots__ = ("flags", "group", "wrappers")

    def __init__(self, flags: frozenset[str], group: int | None) -> None:
        self.flags = flags
        self.group = group
        self.wrappers: list[str] = []


class JavaRegex:
    """Translates one Java pattern into a Python pattern (compiled with re.ASCII) of the same meaning."""

    def __init__(self, source: str) -> None:
        self.src = source
        self.i = 0
        self.out: list[str | int] = []  # an int is a back reference to resolve once all groups are known
        self.opened = 0
        self.closed: set[int] = set()
        self.names: dict[str, int] = {}
        self.flags: frozenset[str] = frozenset()
        self.levels = [_Level(self.flags, None)]
        self.last = "other"  # what the last token was: "quantifier", "flags" (an inline (?i)), "other"

    def translate(self) -> str:
        src = self.src
        while self.i < len(src):
            char = src[self.i]
            self.i += 1
            if char in "*+?{":
                self._quantifier(char)
                continue
            self.last = "other"
            if char == "\\":
                self._escape()
            elif char == "[":
                self.out.append(self._char_class())
            elif char == "(":
                self._open()
            elif char == ")":
                self._close()
            elif char == "|":
                wrappers = self.levels[-1].wrappers
                self.out.append(")" * len(wrappers) + "|" + "".join(wrappers))
            elif char == ".":
                self.out.append(self._dot())
            elif char == "^":
                self.out.append(self._caret())
            elif char == "$":
                self.out.append(self._dollar("m" in self.flags))
            else:
                self.out.append(re.escape(char))
        if len(self.levels) > 1:
            raise JavaSyntaxError("Unclosed group")
        self.out.append(")" * len(self.levels[0].wrappers))
        parts: list[str] = []
        for part in self.out:
            if isinstance(part, str):
                parts.append(part)
            elif part > self.opened:
                parts.append("(?!)")  # Java: a reference to a group that never exists never matches
            else:
                raise UnsupportedConstruct(f"a back reference (\\{part}) to a group defined after it")
        return "".join(parts)

    def _quantifier(self, char: str) -> None:
        after_nothing = self.last in ("quantifier", "flags")
        if char == "{":
            repetition = _REPETITION.match(self.src, self.i - 1)
            if repetition is None:
                raise JavaSyntaxError(f"Illegal repetition near index {self.i - 1}")
            self.i = repetition.end()
            quantifier = repetition.group(0) + self._quantifier_mode()
            if not after_nothing:
                self.out.append(quantifier)  # else Java repeats nothing: "a{2}{3}" is "a{2}"
        elif after_nothing:
            raise JavaSyntaxError(f"Dangling meta character '{char}' near index {self.i - 1}")
        else:
            self.out.append(char + self._quantifier_mode())
        self.last = "quantifier"

    def _quantifier_mode(self) -> str:
        """The '?' (reluctant) or '+' (possessive) right after a quantifier, if any."""
        if self.i < len(self.src) and self.src[self.i] in "?+":
            self.i += 1
            return self.src[self.i - 1]
        return ""

    # Java's '.', '^', '$' by the flags in force (DOTALL s, UNIX_LINES d, MULTILINE m).
    def _dot(self) -> str:
        if "s" in self.flags:
            return "(?s:.)"
        return "[^\\n]" if "d" in self.flags else JAVA_DOT

    def _caret(self) -> str:
        if "m" not in self.flags:
            return r"(?:\A)"
        if "d" in self.flags:
            return r"(?!\Z)(?:\A|(?<=\n))"
        return rf"(?!\Z)(?:\A|(?<=[{_TERMINATORS}])(?!(?<=\r)\n))"  # not at the end, not inside \r\n

    def _dollar(self, multiline: bool) -> str:
        if "d" in self.flags:
            return r"(?=\n|\Z)" if multiline else r"(?=\n?\Z)"  # lookarounds: a quantifier may follow
        if multiline:
            return r"(?:\Z|(?=[\r\x85\u2028\u2029])|(?<!\r)(?=\n))"
        return JAVA_END

    def _open(self) -> None:
        src = self.src
        if not src.startswith("?", self.i):
            self.opened += 1
            self.levels.append(_Level(self.flags, self.opened))
            self.out.append("(")
            return
        rest = src[self.i + 1:self.i + 3]
        if rest[:1] in (":", "=", "!", ">") or rest in ("<=", "<!"):
            kind = "(?" + (rest if rest[:1] == "<" else rest[:1])
            self.i += len(kind) - 1
            self.levels.append(_Level(self.flags, None))
            self.out.append(kind)
            return
        if rest[:1] == "<":
            named = _NAME.match(src, self.i + 1)
            if named is None:
                raise JavaSyntaxError(f"bad named capturing group near index {self.i}")
            name = named.group(1)
            if name in self.names:
                raise JavaSyntaxError(f"Named capturing group <{name}> is already defined")
            self.opened += 1
            self.names[name] = self.opened
            self.levels.append(_Level(self.flags, self.opened))
            self.out.append(f"(?P<{name}>")
            self.i = named.end()
            return
        flags = _FLAGS.match(src, self.i + 1)
        if flags is None:
            raise JavaSyntaxError(f"Unknown inline modifier near index {self.i + 1}")
        on, off = flags.group(1), flags.group(2) or ""
        for letter in on + off:
            if letter in "uUx":
                raise UnsupportedConstruct(f"the inline flag (?{letter})")
        new = (self.flags | frozenset(on)) - frozenset(off)
        self.i = flags.end()
        if flags.group(3) == ":":  # (?flags:X): X with these flags
            self.levels.append(_Level(self.flags, None))
            self.out.append("(?i:" if "i" in new else "(?-i:")
        else:  # (?flags): to the end of the enclosing group, across |
            if ("i" in new) != ("i" in self.flags):
                wrapper = "(?i:" if "i" in new else "(?-i:"
                self.levels[-1].wrappers.append(wrapper)
                self.out.append(wrapper)
            self.last = "flags"
        self.flags = new

    def _close(self) -> None:
        if len(self.levels) == 1:
            raise JavaSyntaxError("Unmatched closing ')'")
        level = self.levels.pop()
        self.out.append(")" * len(level.wrappers) + ")")
        if level.group is not None:
            self.closed.add(level.group)
        self.flags = level.flags

    def _escape(self) -> None:
        src = self.src
        if self.i >= len(src):
            raise JavaSyntaxError("Unexpected internal error (a trailing backslash)")
        char = src[self.i]
        self.i += 1
        if char == "Q":
            end = src.find("\\E", self.i)
            end = len(src) if end < 0 else end
            self.out.append("".join(re.escape(c) for c in src[self.i:end]))
            self.i = min(end + 2, len(src))
        elif char in "123456789":
            self._back_reference(int(char))
        elif char == "k":
            named = _NAME.match(src, self.i)
            if named is None:
                raise JavaSyntaxError("\\k is not followed by <name>")
            group = self.names.get(named.group(1))
            if group is None:
                raise JavaSyntaxError(f"named capturing group <{named.group(1)}> does not exist")
            if group not in self.closed:
                raise UnsupportedConstruct(f"a back reference (\\k<{named.group(1)}>) inside the group it names")
            self.out.append(f"(?P={named.group(1)})")
            self.i = named.end()
        elif char in "bB":
            if char == "b" and src.startswith("{g}", self.i):
                raise UnsupportedConstruct("\\b{g}")
            # JDK 17: letters and digits of any script are word characters for \b (not for \w); and
            # \B holds in an empty string, where Python's \B never does. A group, as Java lets a
            # quantifier follow an anchor.
            self.out.append(r"(?u:\b)" if char == "b" else r"(?u:(?!\b))")
        elif char == "A":
            self.out.append(r"(?:\A)")
        elif char == "z":
            self.out.append(r"(?:\Z)")
        elif char == "Z":
            self.out.append(self._dollar(False))
        elif char in "GX":
            raise UnsupportedConstruct(f"\\{char}")
        elif char == "R":
            self.out.append(rf"(?:\r\n|[{_VERTICAL}])")
        elif char in "dDsSwW":
            self.out.append("\\" + char)
        elif char in "hHvV":
            chars = _HORIZONTAL if char in "hH" else _VERTICAL
            self.out.append(f"[{chars}]" if char.islower() else f"[^{chars}]")
        elif char in "pP":
            chars = self._property(char)
            self.out.append(f"[{chars}]" if char == "p" else f"[^{chars}]")
        else:
            self.out.append(re.escape(self._char_escape(char)))

    def _back_reference(self, group: int) -> None:
        src = self.src
        # Java: more digits while the number still names a group opened so far.
        while self.i < len(src) and src[self.i] in "0123456789" and group * 10 + int(src[self.i]) <= self.opened:
            group = group * 10 + int(src[self.i])
            self.i += 1
        if group >= 100:
            raise UnsupportedConstruct(f"a back reference to group {group}")
        if group in self.closed:
            self.out.append(f"(?:\\{group})")
        elif group <= self.opened:
            raise UnsupportedConstruct(f"a back reference (\\{group}) inside the group it names")
        else:
            self.out.append(group)  # resolved at the end: a later group, or none

    def _property(self, letter: str) -> str:
        src = self.src
        if src.startswith("{", self.i):
            end = src.find("}", self.i)
            if end < 0:
                raise JavaSyntaxError("Unclosed character family")
            name = src[self.i + 1:end]
            self.i = end + 1
        elif self.i < len(src):
            name = src[self.i]
            self.i += 1
        else:
            raise JavaSyntaxError("Illegal character family")
        if name not in _POSIX:
            raise UnsupportedConstruct(f"\\{letter}{{{name}}} (only the POSIX classes like \\p{{Alpha}} are supported)")
        return _POSIX[name]

    def _char_escape(self, char: str) -> str:
        """The single character a Java escape stands for (in or out of a class)."""
        src = self.src
        simple = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "a": "\x07", "e": "\x1b"}
        if char in simple:
            return simple[char]
        if char == "0":
            digits = ""
            while len(digits) < 3 and self.i < len(src) and src[self.i] in _OCTAL:
                if len(digits) == 2 and digits[0] > "3":
                    break
                digits += src[self.i]
                self.i += 1
            if not digits:
                raise JavaSyntaxError("Illegal octal escape sequence")
            return chr(int(digits, 8))
        if char == "x":
            if src.startswith("{", self.i):
                end = src.find("}", self.i)
                digits = src[self.i + 1:end] if end > 0 else ""
                if not digits or not set(digits) <= _HEX:
                    raise JavaSyntaxError("Illegal hexadecimal escape sequence")
                if int(digits, 16) > 0x10FFFF:
                    raise JavaSyntaxError("Hexadecimal codepoint is too big")
                self.i = end + 1
                return chr(int(digits, 16))
            digits = src[self.i:self.i + 2]
            if len(digits) != 2 or not set(digits) <= _HEX:
                raise JavaSyntaxError("Illegal hexadecimal escape sequence")
            self.i += 2
            return chr(int(digits, 16))
        if char == "u":
            unit = self._utf16_unit()
            if 0xD800 <= unit <= 0xDBFF and src.startswith("\\u", self.i):
                save = self.i
                self.i += 2
                low = self._utf16_unit()
                if 0xDC00 <= low <= 0xDFFF:
                    return chr(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))
                self.i = save
            return chr(unit)
        if char == "c":
            if self.i >= len(src):
                raise JavaSyntaxError("Illegal control escape sequence")
            self.i += 1
            return chr(ord(src[self.i - 1]) ^ 64)
        if char == "N":
            end = src.find("}", self.i)
            if not src.startswith("{", self.i) or end < 0:
                raise JavaSyntaxError("\\N is not followed by {name}")
            try:
                named = unicodedata.lookup(src[self.i + 1:end])
            except KeyError:
                raise JavaSyntaxError(f"Unknown character name [{src[self.i + 1:end]}]") from None
            self.i = end + 1
            return named
        if char.isascii() and char.isalnum():
            raise JavaSyntaxError(f"Illegal/unsupported escape sequence \\{char}")
        return char  # a backslash before any other character: that character

    def _utf16_unit(self) -> int:
        digits = self.src[self.i:self.i + 4]
        if len(digits) != 4 or not set(digits) <= _HEX:
            raise JavaSyntaxError("Illegal Unicode escape sequence")
        self.i += 4
        return int(digits, 16)

    def _char_class(self) -> str:
        """A Java character class ``[...]`` (just after '['), without nesting or intersections."""
        src = self.src
        negate = src.startswith("^", self.i)
        self.i += negate
        # Tokens: ("c", char) a single char, ("-", "-") an unquoted '-', ("s", text) a class of several.
        tokens: list[tuple[str, str]] = []
        first = True
        while True:
            if self.i >= len(src):
                raise JavaSyntaxError("Unclosed character class")
            char = src[self.i]
            self.i += 1
            if char == "]" and not first:
                break
            first = False
            if char == "[":
                raise UnsupportedConstruct("a character class inside a character class")
            if char == "&" and src.startswith("&", self.i):
                raise UnsupportedConstruct("a character class intersection (&&)")
            if char == "-":
                tokens.append(("-", "-"))
            elif char != "\\":
                tokens.append(("c", char))
            else:
                if self.i >= len(src):
                    raise JavaSyntaxError("Unclosed character class")
                char = src[self.i]
                self.i += 1
                if char == "Q":
                    end = src.find("\\E", self.i)
                    end = len(src) if end < 0 else end
                    tokens.extend(("c", c) for c in src[self.i:end])
                    self.i = min(end + 2, len(src))
                elif char in "dDsSwW":
                    tokens.append(("s", "\\" + char))
                elif char in "hv":
                    tokens.append(("s", _HORIZONTAL if char == "h" else _VERTICAL))
                elif char == "p":
                    tokens.append(("s", self._property(char)))
                elif char in "HVP":
                    raise UnsupportedConstruct(f"\\{char} inside a character class")
                elif char.isascii() and ((char.isdigit() and char != "0") or char in "bBAZzGRXk"):
                    raise JavaSyntaxError(f"Illegal/unsupported escape sequence \\{char}")
                else:
                    tokens.append(("c", self._char_escape(char)))
        pieces: list[str] = []
        k = 0
        while k < len(tokens):
            kind, text = tokens[k]
            if kind != "s" and k + 2 < len(tokens) and tokens[k + 1][0] == "-":
                last_kind, last = tokens[k + 2]
                if last_kind == "s" or ord(last) < ord(text):
                    raise JavaSyntaxError("Illegal character range")
                pieces.append(f"{re.escape(text)}-{re.escape(last)}")
                k += 3
                continue
            pieces.append(text if kind == "s" else re.escape(text))
            k += 1
        if not pieces:
            raise JavaSyntaxError("Unclosed character class")
        return "[" + "^" * negate + "".join(pieces) + "]"
