"""Kafka's ``ssl.principal.mapping.rules``: a TLS client certificate's subject to a principal name.

Pure functions, no I/O. Follows Kafka's ``org.apache.kafka.common.security.ssl.SslPrincipalMapper``
(which ``DefaultKafkaPrincipalBuilder`` applies to ``X500Principal.getName()`` of the peer's
certificate) and the JDK's RFC 2253 rendering of that subject.

Guarantees:
- ``SslPrincipalMapper.from_rules`` splits the config string where Kafka splits it (a comma ends a
  rule only where a whole ``DEFAULT`` or ``RULE:pattern/replacement/[L|U]`` ends; commas inside a
  pattern or replacement need no escaping; ``\\/`` is a slash inside them; whitespace, newlines and
  empty entries around commas are skipped, but a newline is no separator: as in Kafka, a rule
  followed by a newline and another rule without a comma between them is silently dropped) and
  refuses, with ``PrincipalMappingError`` naming the rule, every rule Kafka refuses (``default``,
  ``DEFAULT/L``, ``RULE:a/b``, ``RULE:a/b/LU``, a pattern Java cannot compile, ...);
- ``principal_name`` returns what Kafka returns: the first rule that applies wins; ``DEFAULT``
  returns the DN unchanged; a ``RULE`` applies when its pattern matches the whole DN, and then the
  result is Java's ``dn.replaceAll(pattern, replacement)`` (``$n``, ``${name}``, ``\\x`` escapes,
  and Kafka's treatment of ``$n`` beyond the last group as literal text), lower- or upper-cased by
  ``/L`` or ``/U``; when no rule applies it raises ``NoMatchingRule`` with Kafka's message;
- patterns are Java regular expressions, run by Python's ``re`` after a translation that keeps
  Java's meaning (ASCII ``\\w \\d \\s`` and case folding, ``\\b`` taking letters and digits of any
  script as word characters as JDK 17 does, Java's line terminators for ``.``, ``^``, ``$``,
  ``\\Z``; ``\\Q..\\E``, ``(?<name>..)``, ``\\k<name>``, ``\\h``, ``\\v``, ``\\R``,
  ``\\e``, ``\\cX``, ``\\0oct``, ``\\x{h..}``, POSIX ``\\p{Alpha}``-style classes, inline flags
  ``i d m s`` anywhere). A Java construct that ``re`` cannot express the same way (class
  intersection ``&&`` or nesting, ``\\p{L}``-style Unicode properties, flags ``u U x``, ``\\G``,
  ``\\X``, back references to a group not yet closed) is refused at ``from_rules`` with
  ``PrincipalMappingError``, never run with another meaning;
- one deliberate difference: a replacement Java would reject when the rule fires (``$x``, a
  trailing ``$``, ``${name}`` of no group, a ``$n`` of a missing group that Kafka does not make
  literal) is refused at ``from_rules`` instead of failing each authentication it matches;
- another, at the brief's request: an empty or blank rules string means ``DEFAULT`` (Kafka keeps no
  rule for ``""``, so every certificate would fail); ``None`` means ``DEFAULT`` as in Kafka;
- ``distinguished_name`` renders a ``getpeercert()['subject']`` as ``X500Principal.getName()``
  does: RDNs most specific first, ``CN C L ST O OU STREET DC UID`` by keyword and RFC 2253 escaping
  of their values (``, = + < > # ; " \\`` anywhere, NUL as ``\\00``, each leading or trailing space
  or CR), multi-valued RDNs joined by ``+`` in certificate order, and every other attribute as its
  OID with ``#`` and the hex of the value's DER encoding. ``getpeercert`` does not say which ASN.1
  string type a value had, so that hex assumes IA5String for emailAddress, PrintableString for
  serialNumber, dnQualifier and jurisdictionCountryName, and UTF8String otherwise (what OpenSSL
  and ``cryptography`` write); keyword attributes are exact for PrintableString, UTF8String and
  IA5String values (the types RFC 5280 allows), not for BMPString or UniversalString ones.

Known differences from Kafka on JDK 17, found by differential testing and left alone: JDK 19 and
later count only ASCII as word characters for ``\\b``; ``/L`` and ``/U`` use Python's Unicode tables,
which also map letters newer than JDK 17's Unicode 13 (40 of them on Python 3.11); and where a
pattern matches the empty string next to a character outside the BMP, Java's ``replaceAll`` steps
into the middle of its UTF-16 surrogate pair and splits it, while this module keeps it whole.
"""

from __future__ import annotations

import re
import ssl
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "NoMatchingRule",
    "PrincipalMappingError",
    "SslPrincipalMapper",
    "distinguished_name",
]


class PrincipalMappingError(ValueError):
    """A principal mapping rule that cannot be used (the message names the rule and why)."""


class NoMatchingRule(PrincipalMappingError):
    """No rule applies to a distinguished name (Kafka's ``SslPrincipalMapper.NoMatchingRule``)."""


# --- splitting and parsing the config string (Kafka: SslPrincipalMapper.splitRules / parseRules) ---

_WS = r" \t\n\x0b\f\r"  # Java's \s
_DOT = r"[^\n\r\x85\u2028\u2029]"  # Java's '.' (no DOTALL, no UNIX_LINES): any char but a line terminator
# Java's '$' without MULTILINE: at the end, or before a line terminator ending the input (not inside \r\n).
_END = r"(?:\Z|(?=\r\n\Z)|(?=[\r\x85\u2028\u2029]\Z)|(?<!\r)(?=\n\Z))"
# One rule, as Kafka's RULE_PATTERN: 1 DEFAULT | RULE: 2 pattern / 4 replacement / 6 [LU] ... | 7 anything else.
_RULE = rf"(DEFAULT)|RULE:((\\{_DOT}|[^\\/])*)/((\\{_DOT}|[^\\/])*)/([LU]?){_DOT}*?|({_DOT}*?)"
_RULE_SPLITTER = re.compile(rf"[{_WS}]*({_RULE})[{_WS}]*(,[{_WS}]*|{_END})")  # Kafka: RULE_SPLITTER, find()
_RULE_PARSER = re.compile(_RULE)  # Kafka: RULE_PARSER, lookingAt()


def _java_trim(text: str) -> str:
    """Java's ``String.trim()``: strips every char up to U+0020 at both ends."""
    start, end = 0, len(text)
    while start < end and text[start] <= " ":
        start += 1
    while end > start and text[end - 1] <= " ":
        end -= 1
    return text[start:end]


@dataclass(frozen=True)
class _Rule:
    """One parsed rule (Kafka: SslPrincipalMapper.Rule)."""

    text: str  # as Kafka's Rule.toString() prints it
    regex: re.Pattern[str] | None  # None: DEFAULT
    template: tuple[str | int, ...] = ()  # the replacement: literal text and group numbers
    case: str = ""  # "L", "U" or ""

    def apply(self, dn: str) -> str | None:
        if self.regex is None:
            return dn
        if self.regex.fullmatch(dn) is None:  # Kafka: Matcher.matches()
            return None
        result = self._replace_all(self.regex, dn)  # Kafka: dn.replaceAll(pattern, replacement)
        if self.case == "L":
            return result.lower()  # Kafka: toLowerCase(Locale.ENGLISH)
        if self.case == "U":
            return result.upper()  # Kafka: toUpperCase(Locale.ENGLISH)
        return result

    def _replace_all(self, regex: re.Pattern[str], dn: str) -> str:
        """Java's Matcher.replaceAll. Not re.sub: after an empty match Java's find() resumes one char
        later, where re.sub would still take a non-empty match at the same place."""
        out: list[str] = []
        copied = start = 0
        while start <= len(dn):
            match = regex.search(dn, start)
            if match is None:
                break
            out.append(dn[copied:match.start()])
            out.extend(part if isinstance(part, str) else (match.group(part) or "") for part in self.template)
            copied = match.end()
            start = match.end() + (match.end() == match.start())
        out.append(dn[copied:])
        return "".join(out)


class SslPrincipalMapper:
    """Kafka's ``SslPrincipalMapper``: maps a certificate's RFC 2253 DN to a principal name."""

    __slots__ = ("_rules",)

    def __init__(self, rules: Sequence[_Rule]) -> None:
        self._rules = tuple(rules)

    @classmethod
    def from_rules(cls, rules: str | None) -> SslPrincipalMapper:
        """Parses ``ssl.principal.mapping.rules``. Raises PrincipalMappingError naming a bad rule."""
        if rules is None or not _java_trim(rules):
            rules = "DEFAULT"  # Kafka: DEFAULT_SSL_PRINCIPAL_MAPPING_RULES (and blank, see the module doc)
        parsed: list[_Rule] = []
        text = _java_trim(rules)
        for split in _RULE_SPLITTER.finditer(text):
            try:
                rule = _parse_rule(split.group(1))
            except PrincipalMappingError as exc:
                # Kafka names only the entry, which ends at the first comma when a RULE does not parse.
                rest = text[split.start(1):]
                if rest == split.group(1):
                    raise
                snippet = rest if len(rest) <= 80 else rest[:80] + "..."
                raise PrincipalMappingError(f"{exc}, at {snippet!r}") from None
            if rule is not None:
                parsed.append(rule)
        return cls(parsed)

    @property
    def rules(self) -> tuple[str, ...]:
        """The rules in order, as Kafka prints them (``DEFAULT``, ``RULE:pattern/replacement/L``)."""
        return tuple(rule.text for rule in self._rules)

    def principal_name(self, distinguished_name: str) -> str:
        """The principal name of ``distinguished_name`` by the first rule that applies. Raises
        NoMatchingRule when none does (Kafka then fails the authentication)."""
        for rule in self._rules:
            name = rule.apply(distinguished_name)
            if name is not None:
                return name
        # Kafka: SslPrincipalMapper.getName's message.
        raise NoMatchingRule(f"No rules apply to {distinguished_name}, rules [{', '.join(self.rules)}]")

    def __repr__(self) -> str:
        return f"SslPrincipalMapper(rules = [{', '.join(self.rules)}])"  # Kafka: SslPrincipalMapper.toString


def _parse_rule(rule: str) -> _Rule | None:
    """One rule as Kafka's parseRules reads it; None for an empty one (Kafka ignores those)."""
    match = _RULE_PARSER.match(rule)
    assert match is not None  # the last alternative matches the empty string
    if match.end() != len(rule):
        raise PrincipalMappingError(_why_invalid(rule, match))
    if match.group(1) is not None:
        return _Rule("DEFAULT", None)
    pattern, replacement, case = match.group(2), match.group(4), match.group(6)
    if pattern is None or replacement is None:
        return None  # the empty rule between two commas
    text = f"RULE:{pattern}/{replacement}" + (f"/{case}" if case else "")  # Kafka: Rule.toString
    try:
        regex = re.compile(_JavaRegex(pattern).translate(), re.ASCII)
    except _Unsupported as exc:
        raise PrincipalMappingError(f"invalid rule {rule!r}: its pattern {pattern!r} uses {exc}, which this "
                                    "proxy cannot run with Java's meaning") from None
    except (_JavaSyntax, re.error) as exc:
        raise PrincipalMappingError(f"invalid rule {rule!r}: its pattern {pattern!r} is not a valid Java "
                                    f"regular expression: {exc}") from None
    try:
        template = _java_replacement(_kafka_literal_back_references(replacement, regex.groups), regex)
    except _JavaSyntax as exc:
        raise PrincipalMappingError(f"invalid rule {rule!r}: its replacement {replacement!r} is not valid for "
                                    f"its pattern: {exc} (Kafka would fail every authentication it "
                                    "matches; write a literal '$' as \\$)") from None
    return _Rule(text, regex, template, case)


def _why_invalid(rule: str, match: re.Match[str]) -> str:
    rest = rule[match.end():]
    if match.group(1) is not None:
        return f"invalid rule {rule!r}: nothing may follow DEFAULT, found {rest!r}"
    slash = "(a '/' inside a pattern or replacement is written \\/)"
    if match.group(2) is not None:
        return (f"invalid rule {rule!r}: only L or U may follow the '/' that ends the replacement, found "
                f"{rest!r} {slash}")
    if rule.startswith("RULE:"):
        return f"invalid rule {rule!r}: a RULE is RULE:pattern/replacement/ with an optional L or U {slash}"
    return f"invalid rule {rule!r}: a rule is DEFAULT or RULE:pattern/replacement/[L|U] (upper case keywords)"


# --- the replacement (Kafka: Rule.escapeLiteralBackReferences, then Java's Matcher.appendReplacement) ---

_BACK_REFERENCE = re.compile(r"\$([0-9]+)")
_JAVA_INT_MAX = 2**31 - 1


def _kafka_literal_back_references(replacement: str, groups: int) -> str:
    """Kafka's escapeLiteralBackReferences: a ``$n`` naming no group (after dropping trailing digits
    while n >= 10) gets a backslash, so Java reads it as literal text. Like Kafka, it searches the
    original text but inserts into the growing copy, so a second such ``$n`` gets its backslash one
    place early per backslash already added (then Java usually fails the rule; so do we)."""
    if groups == 0:
        return replacement
    value = replacement
    for ref in _BACK_REFERENCE.finditer(replacement):
        digits = ref.group(1)
        if digits.startswith("0"):
            continue
        index = int(digits)
        if index > _JAVA_INT_MAX:
            raise _JavaSyntax(f"${digits} is not a Java int (Kafka's Integer.parseInt fails)")
        while index > groups and index >= 10:
            index //= 10
        if index > groups:
            at = ref.start(1) - 1
            value = value[:at] + "\\" + value[at:]
    return value


def _java_replacement(text: str, regex: re.Pattern[str]) -> tuple[str | int, ...]:
    """Java's replacement syntax as literal text and group numbers: ``\\x`` is x, ``$n`` takes the
    longest number that names a group, ``${name}`` a named group. Raises _JavaSyntax where Java throws."""
    parts: list[str | int] = []
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        i += 1
        if char == "\\":
            if i == n:
                raise _JavaSyntax("character to be escaped is missing")
            literal.append(text[i])
            i += 1
            continue
        if char != "$":
            literal.append(char)
            continue
        if i == n:
            raise _JavaSyntax("Illegal group reference: group index is missing")
        if text[i] == "{":
            end = i + 1
            while end < n and text[end].isascii() and text[end].isalnum():
                end += 1
            name = text[i + 1:end]
            if not name:
                raise _JavaSyntax("named capturing group has 0 length name")
            if end == n or text[end] != "}":
                raise _JavaSyntax("named capturing group is missing trailing '}'")
            if name[0].isdigit():
                raise _JavaSyntax(f"capturing group name {{{name}}} starts with digit character")
            if name not in regex.groupindex:
                raise _JavaSyntax(f"No group with name {{{name}}}")
            group = regex.groupindex[name]
            i = end + 1
        else:
            if text[i] not in "0123456789":
                raise _JavaSyntax("Illegal group reference")
            group = int(text[i])
            i += 1
            while i < n and text[i] in "0123456789" and group * 10 + int(text[i]) <= regex.groups:
                group = group * 10 + int(text[i])
                i += 1
            if group > regex.groups:
                raise _JavaSyntax(f"No group {group}")
        if literal:
            parts.append("".join(literal))
            literal.clear()
        parts.append(group)
    if literal:
        parts.append("".join(literal))
    return tuple(parts)


# --- Java regular expressions for Python's re (java.util.regex.Pattern semantics) ---

class _JavaSyntax(Exception):
    """Java's Pattern.compile (or Matcher.appendReplacement) would throw this."""


class _Unsupported(Exception):
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


class _JavaRegex:
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
            raise _JavaSyntax("Unclosed group")
        self.out.append(")" * len(self.levels[0].wrappers))
        parts: list[str] = []
        for part in self.out:
            if isinstance(part, str):
                parts.append(part)
            elif part > self.opened:
                parts.append("(?!)")  # Java: a reference to a group that never exists never matches
            else:
                raise _Unsupported(f"a back reference (\\{part}) to a group defined after it")
        return "".join(parts)

    def _quantifier(self, char: str) -> None:
        after_nothing = self.last in ("quantifier", "flags")
        if char == "{":
            repetition = _REPETITION.match(self.src, self.i - 1)
            if repetition is None:
                raise _JavaSyntax(f"Illegal repetition near index {self.i - 1}")
            self.i = repetition.end()
            quantifier = repetition.group(0) + self._quantifier_mode()
            if not after_nothing:
                self.out.append(quantifier)  # else Java repeats nothing: "a{2}{3}" is "a{2}"
        elif after_nothing:
            raise _JavaSyntax(f"Dangling meta character '{char}' near index {self.i - 1}")
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
        return "[^\\n]" if "d" in self.flags else _DOT

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
        return _END

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
                raise _JavaSyntax(f"bad named capturing group near index {self.i}")
            name = named.group(1)
            if name in self.names:
                raise _JavaSyntax(f"Named capturing group <{name}> is already defined")
            self.opened += 1
            self.names[name] = self.opened
            self.levels.append(_Level(self.flags, self.opened))
            self.out.append(f"(?P<{name}>")
            self.i = named.end()
            return
        flags = _FLAGS.match(src, self.i + 1)
        if flags is None:
            raise _JavaSyntax(f"Unknown inline modifier near index {self.i + 1}")
        on, off = flags.group(1), flags.group(2) or ""
        for letter in on + off:
            if letter in "uUx":
                raise _Unsupported(f"the inline flag (?{letter})")
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
            raise _JavaSyntax("Unmatched closing ')'")
        level = self.levels.pop()
        self.out.append(")" * len(level.wrappers) + ")")
        if level.group is not None:
            self.closed.add(level.group)
        self.flags = level.flags

    def _escape(self) -> None:
        src = self.src
        if self.i >= len(src):
            raise _JavaSyntax("Unexpected internal error (a trailing backslash)")
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
                raise _JavaSyntax("\\k is not followed by <name>")
            group = self.names.get(named.group(1))
            if group is None:
                raise _JavaSyntax(f"named capturing group <{named.group(1)}> does not exist")
            if group not in self.closed:
                raise _Unsupported(f"a back reference (\\k<{named.group(1)}>) inside the group it names")
            self.out.append(f"(?P={named.group(1)})")
            self.i = named.end()
        elif char in "bB":
            if char == "b" and src.startswith("{g}", self.i):
                raise _Unsupported("\\b{g}")
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
            raise _Unsupported(f"\\{char}")
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
            raise _Unsupported(f"a back reference to group {group}")
        if group in self.closed:
            self.out.append(f"(?:\\{group})")
        elif group <= self.opened:
            raise _Unsupported(f"a back reference (\\{group}) inside the group it names")
        else:
            self.out.append(group)  # resolved at the end: a later group, or none

    def _property(self, letter: str) -> str:
        src = self.src
        if src.startswith("{", self.i):
            end = src.find("}", self.i)
            if end < 0:
                raise _JavaSyntax("Unclosed character family")
            name = src[self.i + 1:end]
            self.i = end + 1
        elif self.i < len(src):
            name = src[self.i]
            self.i += 1
        else:
            raise _JavaSyntax("Illegal character family")
        if name not in _POSIX:
            raise _Unsupported(f"\\{letter}{{{name}}} (only the POSIX classes like \\p{{Alpha}} are supported)")
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
                raise _JavaSyntax("Illegal octal escape sequence")
            return chr(int(digits, 8))
        if char == "x":
            if src.startswith("{", self.i):
                end = src.find("}", self.i)
                digits = src[self.i + 1:end] if end > 0 else ""
                if not digits or not set(digits) <= _HEX:
                    raise _JavaSyntax("Illegal hexadecimal escape sequence")
                if int(digits, 16) > 0x10FFFF:
                    raise _JavaSyntax("Hexadecimal codepoint is too big")
                self.i = end + 1
                return chr(int(digits, 16))
            digits = src[self.i:self.i + 2]
            if len(digits) != 2 or not set(digits) <= _HEX:
                raise _JavaSyntax("Illegal hexadecimal escape sequence")
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
                raise _JavaSyntax("Illegal control escape sequence")
            self.i += 1
            return chr(ord(src[self.i - 1]) ^ 64)
        if char == "N":
            end = src.find("}", self.i)
            if not src.startswith("{", self.i) or end < 0:
                raise _JavaSyntax("\\N is not followed by {name}")
            try:
                named = unicodedata.lookup(src[self.i + 1:end])
            except KeyError:
                raise _JavaSyntax(f"Unknown character name [{src[self.i + 1:end]}]") from None
            self.i = end + 1
            return named
        if char.isascii() and char.isalnum():
            raise _JavaSyntax(f"Illegal/unsupported escape sequence \\{char}")
        return char  # a backslash before any other character: that character

    def _utf16_unit(self) -> int:
        digits = self.src[self.i:self.i + 4]
        if len(digits) != 4 or not set(digits) <= _HEX:
            raise _JavaSyntax("Illegal Unicode escape sequence")
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
                raise _JavaSyntax("Unclosed character class")
            char = src[self.i]
            self.i += 1
            if char == "]" and not first:
                break
            first = False
            if char == "[":
                raise _Unsupported("a character class inside a character class")
            if char == "&" and src.startswith("&", self.i):
                raise _Unsupported("a character class intersection (&&)")
            if char == "-":
                tokens.append(("-", "-"))
            elif char != "\\":
                tokens.append(("c", char))
            else:
                if self.i >= len(src):
                    raise _JavaSyntax("Unclosed character class")
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
                    raise _Unsupported(f"\\{char} inside a character class")
                elif char.isascii() and (char.isdigit() and char != "0" or char in "bBAZzGRXk"):
                    raise _JavaSyntax(f"Illegal/unsupported escape sequence \\{char}")
                else:
                    tokens.append(("c", self._char_escape(char)))
        pieces: list[str] = []
        k = 0
        while k < len(tokens):
            kind, text = tokens[k]
            if kind != "s" and k + 2 < len(tokens) and tokens[k + 1][0] == "-":
                last_kind, last = tokens[k + 2]
                if last_kind == "s" or ord(last) < ord(text):
                    raise _JavaSyntax("Illegal character range")
                pieces.append(f"{re.escape(text)}-{re.escape(last)}")
                k += 3
                continue
            pieces.append(text if kind == "s" else re.escape(text))
            k += 1
        if not pieces:
            raise _JavaSyntax("Unclosed character class")
        return "[" + "^" * negate + "".join(pieces) + "]"


# --- the certificate subject as X500Principal.getName() (RFC 2253) prints it ---

# OIDs Java prints by keyword in RFC 2253 (sun.security.x509.AVAKeyword, the RFC 2253 compliant ones).
_RFC2253_KEYWORDS = {
    "2.5.4.3": "CN",
    "2.5.4.6": "C",
    "2.5.4.7": "L",
    "2.5.4.8": "ST",
    "2.5.4.10": "O",
    "2.5.4.11": "OU",
    "2.5.4.9": "STREET",
    "0.9.2342.19200300.100.1.25": "DC",
    "0.9.2342.19200300.100.1.1": "UID",
}
# The names getpeercert() uses (OpenSSL's long names) for the usual subject attributes.
_OIDS = {
    "commonName": "2.5.4.3",
    "countryName": "2.5.4.6",
    "localityName": "2.5.4.7",
    "stateOrProvinceName": "2.5.4.8",
    "organizationName": "2.5.4.10",
    "organizationalUnitName": "2.5.4.11",
    "streetAddress": "2.5.4.9",
    "domainComponent": "0.9.2342.19200300.100.1.25",
    "userId": "0.9.2342.19200300.100.1.1",
    "emailAddress": "1.2.840.113549.1.9.1",
    "serialNumber": "2.5.4.5",
    "dnQualifier": "2.5.4.46",
    "jurisdictionCountryName": "1.3.6.1.4.1.311.60.2.1.3",
}
# The DER tag assumed for a value printed in hex: IA5String, PrintableString, else UTF8String.
_IA5, _PRINTABLE, _UTF8 = 0x16, 0x13, 0x0C
_TAGS = {
    "1.2.840.113549.1.9.1": _IA5,
    "2.5.4.5": _PRINTABLE,
    "2.5.4.46": _PRINTABLE,
    "1.3.6.1.4.1.311.60.2.1.3": _PRINTABLE,
}
_DOTTED = re.compile(r"[0-9]+(?:\.[0-9]+)+")
_ESCAPED = frozenset(',=+<>#;"\\')  # sun.security.x509.AVA.toRFC2253String escapes these anywhere


def distinguished_name(subject: Sequence[Sequence[tuple[str, str]]]) -> str:
    """The RFC 2253 DN Kafka's principal builder sees for ``getpeercert()['subject']`` (Java's
    ``X500Principal.getName()``), e.g. ``CN=alice,O=Acme,C=US``. Raises ValueError for an
    attribute name that is neither a known name nor a dotted OID."""
    # javax.security.auth.x500.X500Principal.getName(): the last RDN of the certificate first.
    return ",".join("+".join(_attribute(name, value) for name, value in rdn) for rdn in reversed(subject))


def _attribute(name: str, value: str) -> str:
    oid = _oid(name)
    keyword = _RFC2253_KEYWORDS.get(oid)
    if keyword is not None:
        return f"{keyword}={_escape(value)}"
    # sun.security.x509.AVA: any other attribute is its OID, '#' and the hex of the value's DER.
    tag = _TAGS.get(oid, _UTF8)
    data = value.encode("utf-8")
    if tag != _UTF8 and not value.isascii():
        tag = _UTF8  # not an IA5String or PrintableString after all
    return f"{oid}=#{tag:02x}{_der_length(len(data)).hex()}{data.hex()}"


def _oid(name: str) -> str:
    if name in _OIDS:
        return _OIDS[name]
    if _DOTTED.fullmatch(name):
        return name
    try:
        return ssl._ASN1Object.fromname(name).oid  # OpenSSL's own table, which named it
    except ValueError:
        raise ValueError(f"unknown certificate subject attribute {name!r}") from None


def _der_length(length: int) -> bytes:
    if length < 0x80:
        return bytes([length])
    octets = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(octets)]) + octets


def _escape(value: str) -> str:
    """A value escaped as sun.security.x509.AVA.toRFC2253String does it."""
    units = ["\\" + c if c in _ESCAPED else "\\00" if c == "\x00" else c for c in value]
    lead = 0
    while lead < len(units) and units[lead] in (" ", "\r"):
        lead += 1
    trail = len(units)
    while trail > lead and units[trail - 1] in (" ", "\r"):
        trail -= 1
    return "".join("\\" + u if i < lead or i >= trail else u for i, u in enumerate(units))
