"""with_throttle raises throttle_time_ms to max(broker's, proxy's) for every API that has it."""

from __future__ import annotations

import pytest

from protocol.apis import SPECS
from protocol.headers import encode_response_header, response_header_is_flexible
from protocol.messages import decode_response, encode_body
from protocol.throttle import has_throttle_field, throttle_of, with_throttle

CASES = [
    (key, v)
    for key, spec in sorted(SPECS.items())
    for v in range(spec.max_version + 1)
    if has_throttle_field(key, v)
]


def _frame(key, version, broker_throttle):
    resp = SPECS[key].response[version]()
    resp.throttle_time_ms = broker_throttle
    if key == 18:
        resp.error_code = 0
    return encode_response_header(77, response_header_is_flexible(key, version)) + encode_body(resp)


@pytest.mark.parametrize("key, version", CASES, ids=[f"{SPECS[k].name}-v{v}" for k, v in CASES])
def test_raises_to_the_proxy_throttle_and_keeps_a_higher_broker_throttle(key, version):
    frame = _frame(key, version, 10)
    out = with_throttle(key, version, frame, 2500)
    assert throttle_of(key, version, out) == 2500
    assert out[:4] == frame[:4]  # correlation id untouched
    assert with_throttle(key, version, _frame(key, version, 9000), 2500) == _frame(key, version, 9000)
    # nothing else in the body changed
    offset = len(encode_response_header(77, response_header_is_flexible(key, version)))
    a = decode_response(key, version, memoryview(out)[offset:])
    b = decode_response(key, version, memoryview(frame)[offset:])
    a.throttle_time_ms = b.throttle_time_ms
    assert encode_body(a) == encode_body(b)


def test_versions_without_the_field_are_returned_unchanged():
    frame = encode_response_header(1, False) + encode_body(SPECS[0].response[0](responses=[]))
    assert not has_throttle_field(0, 0)
    assert with_throttle(0, 0, frame, 100) is frame
