"""Kafka's ssl.principal.mapping.rules (SslPrincipalMapper) and the RFC 2253 DN of a certificate.

The expected values are Kafka's own: the mapping vectors were checked against a copy of Kafka's
SslPrincipalMapper running on JDK 17's java.util.regex, the DNs against
``javax.security.auth.x500.X500Principal.getName()`` of the same certificate subjects. Two choices
differ from Kafka on purpose, and their tests say so: a blank rules string means DEFAULT, and a
replacement Java would reject is refused when the rules are read rather than at each authentication.
"""

from __future__ import annotations

import ssl

import pytest

from proxy.identity.distinguished_name import distinguished_name
from proxy.identity.ssl_principal import (
    NoMatchingRule,
    PrincipalMappingError,
    SslPrincipalMapper,
)
from tests.support.memory_tls import handshake_in_memory

NO_MATCH = NoMatchingRule  # an expected outcome: no rule applies

# Kafka's documentation ("Customizing SSL User Name"), laid out over lines as the docs show it.
DOC_RULES = """RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/,
RULE:^CN=(.*?),OU=(.*?),O=(.*?),L=(.*?),ST=(.*?),C=(.*?)$/$1@$2/L,
RULE:^.*[Cc][Nn]=([a-zA-Z0-9.]*).*$/$1/L,
DEFAULT"""
DOC_RULES_ONE_LINE = (
    "RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/,RULE:^CN=(.*?),OU=(.*?),O=(.*?),L=(.*?),ST=(.*?),C=(.*?)$/$1@$2/L,"
    "RULE:^.*[Cc][Nn]=([a-zA-Z0-9.]*).*$/$1/L,DEFAULT"
)
DOC_VECTORS = [
    ("CN=serviceuser,OU=ServiceUsers,O=Unknown,L=Unknown,ST=Unknown,C=Unknown", "serviceuser"),
    ("CN=adminUser,OU=Admin,O=Unknown,L=Unknown,ST=Unknown,C=Unknown", "adminuser@admin"),
    ("OU=Ops,CN=Bob.Smith,O=Acme", "bob.smith"),  # only the third rule applies
    ("OU=JavaSoft,O=Sun Microsystems,C=US", "OU=JavaSoft,O=Sun Microsystems,C=US"),  # DEFAULT
]

# Kafka's own SslPrincipalMapperTest rules and names.
KAFKA_TEST_RULES = ", ".join([
    "RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/L",
    "RULE:^CN=(.*?),OU=(.*?),O=(.*?),L=(.*?),ST=(.*?),C=(.*?)$/$1@$2/L",
    "RULE:^cn=(.*?),ou=(.*?),dc=(.*?),dc=(.*?)$/$1@$2/U",
    "RULE:^.*[Cc][Nn]=([a-zA-Z0-9.]*).*$/$1/U",
    "DEFAULT",
])
KAFKA_TEST_VECTORS = [
    ("CN=Duke,OU=ServiceUsers,O=Org,C=US", "duke"),
    ("CN=Duke,OU=SME,O=mycp,L=Fulton,ST=MD,C=US", "duke@sme"),
    ("cn=duke,ou=sme,dc=mycp,dc=com", "DUKE@SME"),
    ("cN=duke,OU=JavaSoft,O=Sun Microsystems", "DUKE"),
    ("OU=JavaSoft,O=Sun Microsystems,C=US", "OU=JavaSoft,O=Sun Microsystems,C=US"),
]

# (rules, distinguished name, principal name or NO_MATCH), each pinning one behaviour.
VECTORS = [
    # first match wins, in the order written
    ("RULE:^CN=([^,]*),.*$/first-$1/,RULE:^CN=([^,]*),O=.*$/second-$1/", "CN=a,O=b", "first-a"),
    ("RULE:^CN=([^,]*),O=.*$/second-$1/,RULE:^CN=([^,]*),.*$/first-$1/", "CN=a,O=b", "second-a"),
    ("DEFAULT,RULE:^CN=(.*)$/$1/", "CN=a", "CN=a"),  # DEFAULT first shadows every later rule
    # DEFAULT as the fallback, and no fallback at all
    ("RULE:^CN=(.*)$/$1/,DEFAULT", "O=x", "O=x"),
    ("RULE:^CN=(.*)$/$1/", "O=x", NO_MATCH),
    # the pattern must match the whole DN (Matcher.matches)
    ("RULE:CN=([a-z]+)/$1/", "CN=abc,O=x", NO_MATCH),
    ("RULE:CN=([a-z]+)/$1/", "CN=abc", "abc"),
    # /L and /U apply to the whole result, replacement text included; none keeps the case
    ("RULE:^CN=([^,]*),O=(.*)$/$1@$2.EXAMPLE/L", "CN=Alice,O=Acme", "alice@acme.example"),
    ("RULE:^CN=([^,]*),O=(.*)$/$1@$2.example/U", "CN=Alice,O=Acme", "ALICE@ACME.EXAMPLE"),
    ("RULE:^CN=([^,]*),O=(.*)$/$1@$2/", "CN=Alice,O=Acme", "Alice@Acme"),
    ("RULE:^CN=(.*)$/$1/U", "CN=straße", "STRASSE"),  # Java's toUpperCase(Locale.ENGLISH)
    # commas: escaped or not, inside a pattern they are the pattern's
    ("RULE:^CN=([^\\,]+)\\,OU=.*$/$1/", "CN=bob,OU=x", "bob"),
    ("RULE:^CN=([^,]+),OU=.*$/$1/,DEFAULT", "CN=bob,OU=x", "bob"),
    ("RULE:^CN=((\\\\, *|\\w)+)(,.*|$)/$1/,DEFAULT", "CN=Tkac\\, Adam,OU=ITZ,DC=geodis,DC=cz", "Tkac\\, Adam"),
    ("RULE:^CN=([^,]*),.*$/$1\\,x/", "CN=a,O=b", "a,x"),  # \, in a replacement is a comma
    # slashes: \/ in a pattern or a replacement is a slash
    ("RULE:^CN=([^\\/]*)\\/([^,]*),.*$/$2\\/$1/", "CN=team/alice,O=x", "alice/team"),  # even in [^\/]
    ("RULE:^CN=(.*)$/a\\/b\\/$1/L", "CN=X", "a/b/x"),
    # replacements as Java reads them, after Kafka's literal $n
    ("RULE:^CN=(.*)$/$0|$1/", "CN=x", "CN=x|x"),
    ("RULE:^CN=(.*)$/\\$1 is $1/", "CN=x", "$1 is x"),
    ("RULE:^CN=(.*)$/$1@$2/", "CN=bob", "bob@$2"),  # Kafka: a $n naming no group is literal text
    ("RULE:^CN=(.*)$/$10/", "CN=bob", "bob0"),  # Java: $1 then 0, as there is no group 10
    ("RULE:^(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)(k)$/$11$12/", "abcdefghijk", "ka2"),  # the longest $n naming a group
    ("RULE:^CN=(?<user>[^,]*)(,.*)?$/${user}/", "CN=carol,O=x", "carol"),
    ("RULE:^CN=(a)|(b)$/[$1][$2]/", "CN=a", "[a][]"),  # a group that took no part is empty
    # Java's replaceAll, not "replace the whole match": later, shorter matches are replaced too
    ("RULE:CN=(.*?)/$1@x/", "CN=alice", "@xalice"),
    ("RULE:a??/-/", "a", "-a-"),  # after an empty match Java's find() moves one char on
    ("RULE:x*/-/", "abxd", NO_MATCH),
    ("RULE:(?:x*|abxd)/-/", "abxd", "-a-b--d-"),
    # Java's regular expressions, not Python's
    ("RULE:^CN=(\\w+)$/$1/", "CN=josé", NO_MATCH),  # \w is ASCII
    ("RULE:(?i)^CN=(é)$/$1/", "CN=É", NO_MATCH),  # case folding is ASCII
    ("RULE:(?i)^cn=(\\w+)$/$1/", "CN=Bob", "Bob"),
    ("RULE:^CN=(.*)$/$1/", "CN=a\rb", NO_MATCH),  # '.' is no line terminator: \r, \x85, \u2028 too
    ("RULE:^CN=(.*)$/$1/", "CN=a\x85b", NO_MATCH),
    ("RULE:(?s)^CN=(.*)$/$1/", "CN=a\rb", "a\rb"),
    ("RULE:(?d)^CN=(.*)$/$1/", "CN=a\rb", "a\rb"),  # UNIX_LINES: only \n ends a line
    ("RULE:^CN=\\Qa.b\\E$/ok/", "CN=a.b", "ok"),
    ("RULE:^CN=\\Qa.b\\E$/ok/", "CN=axb", NO_MATCH),
    ("RULE:^CN=(?i)([a-z]+)$/$1/", "CN=Bob", "Bob"),  # an inline flag from there on
    ("RULE:^CN=(?i)([a-z]+)$/$1/", "cn=bob", NO_MATCH),
    ("RULE:^CN=(a(?i)b|c)$/$1/", "CN=C", "C"),  # ... and across the | after it
    ("RULE:^CN=\\p{Alpha}+\\h\\p{Digit}{2}$/ok/", "CN=ab\xa012", "ok"),
    ("RULE:^CN=a{1}{2}$/ok/", "CN=a", "ok"),  # Java ignores a repetition of a repetition
    ("RULE:^CN=é\\b.*$/ok/", "CN=é x", "ok"),  # JDK 17: any letter is a word char for \b
    ("RULE:^CN=é\\b.*$/ok/", "CN=éx", NO_MATCH),
    ("RULE:^CN=(\\x{41}\\u0042\\0103)$/$1/", "CN=ABC", "ABC"),
]

# (rules, the rules as Kafka keeps them): Kafka's splitting, separators and all.
SPLITTING = [
    ("DEFAULT", ("DEFAULT",)),
    ("RULE://", ("RULE:/",)),
    ("RULE:/.*/", ("RULE:/.*",)),
    ("RULE:/.*/L", ("RULE:/.*/L",)),
    ("RULE://,DEFAULT", ("RULE:/", "DEFAULT")),
    ("  RULE:// ,  DEFAULT  ", ("RULE:/", "DEFAULT")),
    ("  RULE:   /     / ,  DEFAULT  ", ("RULE:   /     ", "DEFAULT")),
    ("  RULE:  /     /U   ,DEFAULT  ", ("RULE:  /     /U", "DEFAULT")),
    ("  RULE:([A-Z]*)/$1/U   ,RULE:([a-z]+)/$1/,   DEFAULT  ", ("RULE:([A-Z]*)/$1/U", "RULE:([a-z]+)/$1", "DEFAULT")),
    (",,RULE://,,,DEFAULT,,", ("RULE:/", "DEFAULT")),  # empty entries are skipped
    (",  , RULE: /   /    ,,,   DEFAULT, ,   ", ("RULE: /   ", "DEFAULT")),
    ("RULE:\\/\\\\\\(\\)\\n\\t/\\/\\//", ("RULE:\\/\\\\\\(\\)\\n\\t/\\/\\/",)),
    ("RULE:\\**\\/+/*/L,RULE:\\/*\\**/**/", ("RULE:\\**\\/+/*/L", "RULE:\\/*\\**/**")),
    (
        "RULE:,RULE:,/,RULE:,\\//U,RULE:,/RULE:,/,RULE:,RULE:,/L,RULE:,/L,RULE:, DEFAULT, /DEFAULT/,DEFAULT",
        ("RULE:,RULE:,/,RULE:,\\//U", "RULE:,/RULE:,", "RULE:,RULE:,/L,RULE:,/L", "RULE:, DEFAULT, /DEFAULT",
         "DEFAULT"),
    ),
    ("RULE:^CN=(.*)$/$1/,\n\t  DEFAULT\n", ("RULE:^CN=(.*)$/$1", "DEFAULT")),  # whitespace and newlines
    ("RULE:^CN=(.*)$/$1/\n,DEFAULT", ("RULE:^CN=(.*)$/$1", "DEFAULT")),
    ("RULE:^CN=(.*)$/$1/\nDEFAULT", ("DEFAULT",)),  # a newline is no separator: Kafka drops the rule
    (",   , , ,      , , ,   ", ()),  # only empty entries: no rule at all
]

# (rules, what the error message says besides the rule): rules Kafka refuses.
INVALID = [
    ("default", "a rule is DEFAULT or RULE:"),
    ("DEFAUL", "a rule is DEFAULT or RULE:"),
    ("DEFAULT/L", "nothing may follow DEFAULT"),
    ("DEFAULT/U", "nothing may follow DEFAULT"),
    ("RULE:CN=(.*?),OU=ServiceUsers.*/$1", "a RULE is RULE:pattern/replacement/"),
    ("rule:^CN=(.*?),OU=ServiceUsers.*$/$1/", "a rule is DEFAULT or RULE:"),
    ("RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/L/U", "only L or U may follow"),
    ("RULE:^CN=(.*?),OU=ServiceUsers.*$/L", "a RULE is RULE:pattern/replacement/"),
    ("RULE:^CN=(.*?),OU=ServiceUsers.*$/U", "a RULE is RULE:pattern/replacement/"),
    ("RULE:^CN=(.*?),OU=ServiceUsers.*$/LU", "a RULE is RULE:pattern/replacement/"),
    ("RULE:^CN=(.*)$/$1/X", "only L or U may follow"),
    ("RULE:^CN=a/b/c/", "only L or U may follow"),  # an unescaped '/' in the replacement
    # patterns Java's Pattern.compile refuses (some of which Python's re would take)
    ("RULE:^CN=(a/$1/", "not a valid Java regular expression"),
    ("RULE:^CN=a{/x/", "not a valid Java regular expression"),
    ("RULE:^CN=x{,3}$/x/", "not a valid Java regular expression"),
    ("RULE:^CN=(?P<n>a)$/x/", "not a valid Java regular expression"),
    ("RULE:^CN=(?<a_b>a)$/x/", "not a valid Java regular expression"),
    ("RULE:^CN=(?#note)a$/x/", "not a valid Java regular expression"),
    ("RULE:^CN=\\0$/x/", "not a valid Java regular expression"),
    ("RULE:^CN=\\y$/x/", "not a valid Java regular expression"),
    ("RULE:^CN=a(?i)?$/x/", "not a valid Java regular expression"),
    ("RULE:^CN=[z-a]$/x/", "not a valid Java regular expression"),
    # replacements Java refuses whenever the rule applies (Kafka reads them, then fails each authentication)
    ("RULE:^CN=(.*)$/$x/", "Illegal group reference"),
    ("RULE:^CN=(.*)$/x$/", "group index is missing"),
    ("RULE:^CN=(.*)$/${nope}/", "No group with name {nope}"),
    ("RULE:^CN=.*$/$1/", "No group 1"),  # no group at all: Kafka leaves $1 to Java
    ("RULE:^CN=(.*)$/$1@$2$3/", "No group 3"),  # Kafka's backslash for $3 lands one place early
]

# Java constructs Python's re cannot run with Java's meaning: refused, never run differently.
UNSUPPORTED = [
    "RULE:^CN=\\p{L}+$/x/",
    "RULE:^CN=[a-z&&[^e]]+$/x/",
    "RULE:^CN=[a[b]]$/x/",
    "RULE:(?u)^CN=a$/x/",
    "RULE:(?x)^CN=a$/x/",
    "RULE:^CN=\\Ga$/x/",
    "RULE:^CN=(a\\1)$/x/",
]


@pytest.mark.parametrize("rules", [DOC_RULES, DOC_RULES_ONE_LINE])
@pytest.mark.parametrize(("dn", "expected"), DOC_VECTORS)
def test_kafka_documentation_examples(rules: str, dn: str, expected: str) -> None:
    assert SslPrincipalMapper.from_rules(rules).principal_name(dn) == expected


@pytest.mark.parametrize(("dn", "expected"), KAFKA_TEST_VECTORS)
def test_kafka_unit_test_examples(dn: str, expected: str) -> None:
    assert SslPrincipalMapper.from_rules(KAFKA_TEST_RULES).principal_name(dn) == expected


@pytest.mark.parametrize(("rules", "dn", "expected"), VECTORS)
def test_principal_name(rules: str, dn: str, expected: str | type[NoMatchingRule]) -> None:
    mapper = SslPrincipalMapper.from_rules(rules)
    if expected is NO_MATCH:
        with pytest.raises(NoMatchingRule):
            mapper.principal_name(dn)
    else:
        assert mapper.principal_name(dn) == expected


@pytest.mark.parametrize(("rules", "expected"), SPLITTING)
def test_rules_are_split_as_kafka_splits_them(rules: str, expected: tuple[str, ...]) -> None:
    mapper = SslPrincipalMapper.from_rules(rules)
    assert mapper.rules == expected
    assert repr(mapper) == f"SslPrincipalMapper(rules = [{', '.join(expected)}])"  # Kafka's toString


def test_no_matching_rule_says_what_kafka_says() -> None:
    mapper = SslPrincipalMapper.from_rules("RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/L, RULE:^O=(x)$/$1/")
    with pytest.raises(NoMatchingRule) as caught:
        mapper.principal_name("CN=a,OU=Other")
    assert str(caught.value) == (
        "No rules apply to CN=a,OU=Other, rules [RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/L, RULE:^O=(x)$/$1]"
    )
    assert isinstance(caught.value, PrincipalMappingError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize("rules", [None, "", "   ", " \n\t "])
def test_no_rules_means_default(rules: str | None) -> None:
    # Kafka: None is DEFAULT; "" (or blank) leaves no rule, so every certificate fails. Here: DEFAULT.
    mapper = SslPrincipalMapper.from_rules(rules)
    assert mapper.rules == ("DEFAULT",)
    assert mapper.principal_name("CN=a,O=b") == "CN=a,O=b"


def test_only_empty_entries_leave_no_rule_and_nothing_maps() -> None:
    with pytest.raises(NoMatchingRule, match=r"rules \[\]"):
        SslPrincipalMapper.from_rules(" , ,").principal_name("CN=a")


@pytest.mark.parametrize(("rule", "why"), INVALID)
def test_invalid_rules_are_refused_naming_the_rule(rule: str, why: str) -> None:
    with pytest.raises(PrincipalMappingError) as caught:
        SslPrincipalMapper.from_rules(rule)
    assert not isinstance(caught.value, NoMatchingRule)
    assert repr(rule) in str(caught.value)
    assert why in str(caught.value)


def test_an_invalid_rule_among_valid_ones_is_named() -> None:
    with pytest.raises(PrincipalMappingError, match=r"invalid rule 'DEFAULT/L': nothing may follow DEFAULT"):
        SslPrincipalMapper.from_rules("RULE:^O=(x)$/$1/, DEFAULT/L, DEFAULT")


def test_an_invalid_rule_with_commas_is_split_at_them_as_kafka_does() -> None:
    # The RULE form fails, so Kafka's splitter ends the entry at its first comma and names that part.
    with pytest.raises(PrincipalMappingError, match=r"invalid rule 'RULE:\^CN=\(\.\*\?\)': a RULE is"):
        SslPrincipalMapper.from_rules("RULE:^CN=(.*?),OU=ServiceUsers.*$/L, DEFAULT")


@pytest.mark.parametrize("rule", UNSUPPORTED)
def test_java_constructs_python_cannot_mirror_are_refused(rule: str) -> None:
    with pytest.raises(PrincipalMappingError, match="cannot run with Java's meaning") as caught:
        SslPrincipalMapper.from_rules(rule)
    assert repr(rule) in str(caught.value)


def test_a_back_reference_to_a_group_that_never_exists_never_matches() -> None:
    mapper = SslPrincipalMapper.from_rules("RULE:^CN=(a)\\2?$/$1/,RULE:^CN=(a)\\2$/no/,DEFAULT")
    assert mapper.principal_name("CN=a") == "a"
    assert mapper.principal_name("CN=aa") == "CN=aa"


# --- distinguished_name: getpeercert()['subject'] as X500Principal.getName() prints it ---

RDN = tuple[tuple[str, str], ...]


def _one(name: str, value: str) -> RDN:
    """A single-valued RDN as getpeercert() gives it."""
    return ((name, value),)


SUBJECTS: list[tuple[tuple[RDN, ...], str]] = [
    # the certificate's order reversed: most specific first, no spaces
    ((_one("countryName", "US"), _one("organizationName", "Acme"), _one("commonName", "alice")),
     "CN=alice,O=Acme,C=US"),
    (
        (_one("domainComponent", "com"), _one("domainComponent", "example"), _one("stateOrProvinceName", "CA"),
         _one("localityName", "SF"), _one("streetAddress", "1 Main St"), _one("organizationalUnitName", "Ops"),
         _one("userId", "u1")),
        "UID=u1,OU=Ops,STREET=1 Main St,L=SF,ST=CA,DC=example,DC=com",
    ),
    # a multi-valued RDN keeps its own order, joined by +
    ((_one("organizationName", "Acme"), (("commonName", "bob"), ("userId", "b1"))), "CN=bob+UID=b1,O=Acme"),
    (((("commonName", "a"), ("organizationalUnitName", "b"), ("organizationalUnitName", "z")),), "CN=a+OU=b+OU=z"),
    # RFC 2253 escaping as the JDK does it: specials anywhere, each leading or trailing space or CR
    (
        (_one("organizationalUnitName", 'a+b=c<d>e#f;g"h\\i'), _one("commonName", "Tkac, Adam")),
        'CN=Tkac\\, Adam,OU=a\\+b\\=c\\<d\\>e\\#f\\;g\\"h\\\\i',
    ),
    (
        (_one("commonName", "#hash"), _one("commonName", " lead"), _one("commonName", "trail  "),
         _one("commonName", "  ")),
        "CN=\\ \\ ,CN=trail\\ \\ ,CN=\\ lead,CN=\\#hash",
    ),
    ((_one("commonName", "in side"), _one("commonName", "\r cr"), _one("commonName", "nul\x00x")),
     "CN=nul\\00x,CN=\\\r\\ cr,CN=in side"),
    ((_one("commonName", "nl\nhere\ttab"), _one("commonName", "café 日本 😀"), _one("commonName", "a@b_c*d!e%f&g")),
     "CN=a@b_c*d!e%f&g,CN=café 日本 😀,CN=nl\nhere\ttab"),
    # other attributes: the OID, '#', and the hex of the value's DER (IA5String for email)
    ((_one("commonName", "alice"), _one("emailAddress", "alice@example.com")),
     "1.2.840.113549.1.9.1=#1611616c696365406578616d706c652e636f6d,CN=alice"),
    ((_one("emailAddress", "y" * 130 + "@e.com"),), "1.2.840.113549.1.9.1=#168188" + "79" * 130 + "40652e636f6d"),
    (
        (_one("serialNumber", "1234"), _one("title", "Boss"), _one("dnQualifier", "q"), _one("businessCategory", "biz"),
         _one("jurisdictionCountryName", "US"), _one("1.2.3.4.5", "custom")),
        "1.2.3.4.5=#0c06637573746f6d,1.3.6.1.4.1.311.60.2.1.3=#13025553,2.5.4.15=#0c0362697a,2.5.4.46=#130171,"
        "2.5.4.12=#0c04426f7373,2.5.4.5=#130431323334",
    ),
    ((), ""),
]


@pytest.mark.parametrize(("subject", "expected"), SUBJECTS)
def test_distinguished_name(subject: tuple[RDN, ...], expected: str) -> None:
    assert distinguished_name(subject) == expected


def test_distinguished_name_refuses_an_unknown_attribute_name() -> None:
    with pytest.raises(ValueError, match="noSuchAttribute"):
        distinguished_name(((("noSuchAttribute", "x"),),))


def test_a_real_client_certificate_maps_by_the_documented_rules() -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA(organization_name="kqp test CA")
    leaf = ca.issue_cert(common_name="Alice", organization_name="Acme", organization_unit_name="ServiceUsers")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("proxy.test").configure_cert(server)
    ca.configure_trust(server)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca.configure_trust(client)
    leaf.configure_cert(client)
    _, side = handshake_in_memory(client, server, "proxy.test")
    peercert = side.getpeercert()
    assert peercert, "the server saw no client certificate"

    dn = distinguished_name(peercert["subject"])
    assert dn == "CN=Alice,OU=ServiceUsers,O=Acme"
    assert SslPrincipalMapper.from_rules(DOC_RULES).principal_name(dn) == "Alice"
