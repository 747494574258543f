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
- patterns are Java regular expressions, run with Java's meaning (proxy.identity.java_regex); a
  construct Python's ``re`` cannot express the same way is refused at ``from_rules`` with
  ``PrincipalMappingError``, never run with another meaning;
- one deliberate difference: a replacement Java would reject when the rule fires (``$x``, a
  trailing ``$``, ``${name}`` of no group, a ``$n`` of a missing group that Kafka does not make
  literal) is refused at ``from_rules`` instead of failing each authentication it matches;
- another, at the brief's request: an empty or blank rules string means ``DEFAULT`` (Kafka keeps no
  rule for ``""``, so every certificate would fail); ``None`` means ``DEFAULT`` as in Kafka;
- rules run on the subject as ``X500Principal.getName()`` prints it
  (proxy.identity.distinguished_name).

Known differences from Kafka on JDK 17, found by differential testing and left alone: JDK 19 and
later count only ASCII as word characters for ``\\b``; ``/L`` and ``/U`` use Python's Unicode tables,
which also map letters newer than JDK 17's Unicode 13 (40 of them on Python 3.11); and where a
pattern matches the empty string next to a character outside the BMP, Java's ``replaceAll`` steps
into the middle of its UTF-16 surrogate pair and splits it, while this module keeps it whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.identity.java_regex import JAVA_DOT, JAVA_END, JavaRegex, JavaSyntaxError, UnsupportedConstruct

__all__ = [
    "NoMatchingRule",
    "PrincipalMappingError",
    "SslPrincipalMapper",
]


class PrincipalMappingError(ValueError):
    """A principal mapping rule that cannot be used (the message names the rule and why)."""


class NoMatchingRule(PrincipalMappingError):
    """No rule applies to a distinguished name (Kafka's ``SslPrincipalMapper.NoMatchingRule``)."""


# --- splitting and parsing the config string (Kafka: SslPrincipalMapper.splitRules / parseRules) ---

_WS = r" \t\n\x0b\f\r"  # Java's \s
_DOT = JAVA_DOT
_END = JAVA_END
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
        regex = re.compile(JavaRegex(pattern).translate(), re.ASCII)
    except UnsupportedConstruct as exc:
        raise PrincipalMappingError(f"invalid rule {rule!r}: its pattern {pattern!r} uses {exc}, which this "
                                    "proxy cannot run with Java's meaning") from None
    except (JavaSyntaxError, re.error) as exc:
        raise PrincipalMappingError(f"invalid rule {rule!r}: its pattern {pattern!r} is not a valid Java "
                                    f"regular expression: {exc}") from None
    try:
        template = _java_replacement(_kafka_literal_back_references(replacement, regex.groups), regex)
    except JavaSyntaxError as exc:
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
            raise JavaSyntaxError(f"${digits} is not a Java int (Kafka's Integer.parseInt fails)")
        while index > groups and index >= 10:
            index //= 10
        if index > groups:
            at = ref.start(1) - 1
            value = value[:at] + "\\" + value[at:]
    return value


def _java_replacement(text: str, regex: re.Pattern[str]) -> tuple[str | int, ...]:
    """Java's replacement syntax as literal text and group numbers: ``\\x`` is x, ``$n`` takes the
    longest number that names a group, ``${name}`` a named group. Raises JavaSyntaxError where Java throws."""
    parts: list[str | int] = []
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        i += 1
        if char == "\\":
            if i == n:
                raise JavaSyntaxError("character to be escaped is missing")
            literal.append(text[i])
            i += 1
            continue
        if char != "$":
            literal.append(char)
            continue
        if i == n:
            raise JavaSyntaxError("Illegal group reference: group index is missing")
        if text[i] == "{":
            end = i + 1
            while end < n and text[end].isascii() and text[end].isalnum():
                end += 1
            name = text[i + 1:end]
            if not name:
                raise JavaSyntaxError("named capturing group has 0 length name")
            if end == n or text[end] != "}":
                raise JavaSyntaxError("named capturing group is missing trailing '}'")
            if name[0].isdigit():
                raise JavaSyntaxError(f"capturing group name {{{name}}} starts with digit character")
            if name not in regex.groupindex:
                raise JavaSyntaxError(f"No group with name {{{name}}}")
            group = regex.groupindex[name]
            i = end + 1
        else:
            if text[i] not in "0123456789":
                raise JavaSyntaxError("Illegal group reference")
            group = int(text[i])
            i += 1
            while i < n and text[i] in "0123456789" and group * 10 + int(text[i]) <= regex.groups:
                group = group * 10 + int(text[i])
                i += 1
            if group > regex.groups:
                raise JavaSyntaxError(f"No group {group}")
        if literal:
            parts.append("".join(literal))
            literal.clear()
        parts.append(group)
    if literal:
        parts.append("".join(literal))
    return tuple(parts)
