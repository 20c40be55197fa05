"""The wire format without sockets: keys, schema, limits, MACs."""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import pytest

from chunkstore.errors import ConfigError
from chunkstore.peer import _protocol as P
from chunkstore.peer._errors import ProtocolViolation
from chunkstore.testing.factories import sample_chunks

KEYS = [c.key for c in sample_chunks(3, seed=5)]


def test_keys_round_trip_in_fixed_width() -> None:
    blob = P.pack_keys(KEYS)
    assert len(blob) == 3 * P.KEY_WIRE_BYTES
    assert blob[:8] == bytes.fromhex(KEYS[0].namespace) and blob[8:40] == KEYS[0].digest
    assert P.unpack_keys(blob, P.Limits()) == KEYS


@pytest.mark.parametrize("blob", [b"x" * 39, "text", None])
def test_bad_key_blobs_are_malformed(blob: object) -> None:
    with pytest.raises(ProtocolViolation) as exc:
        P.unpack_keys(blob, P.Limits())
    assert exc.value.code == P.MALFORMED


def test_too_many_keys() -> None:
    with pytest.raises(ProtocolViolation) as exc:
        P.unpack_keys(P.pack_keys(KEYS), P.Limits(max_keys=2))
    assert exc.value.code == P.TOO_LARGE


def test_every_request_op_validates_its_fields() -> None:
    samples = {
        "versions": [1],
        "client": "c",
        "fingerprint": None,
        "chunk_tokens": None,
        "planes": ["inline"],
        "nixl_md": None,
        "s": b"s" * 16,
        "keys": b"",
        "plane": "inline",
        "lease_ms": 0,
        "lease": b"l" * 16,
        "ack": False,
        "sizes": [],
        "addrs": [],
        "mode": "if_absent",
        "namespace": None,
        "after": None,
        "limit": 10,
    }
    for op, fields in P.REQUEST_FIELDS.items():
        body = {"v": 1, "id": 7, "op": op, **{name: samples[name] for name in fields}}
        assert P.validate_request(body) is body
        for name in fields:
            broken = {k: v for k, v in body.items() if k != name}
            with pytest.raises(ProtocolViolation):
                P.validate_request(broken)
            wrong = {**body, name: 3.5}
            with pytest.raises(ProtocolViolation):
                P.validate_request(wrong)


def test_fetch_use_flag_is_optional_but_typed() -> None:
    body = {
        "v": 1,
        "id": 1,
        "op": "fetch",
        "s": b"s" * 16,
        "keys": b"",
        "plane": "inline",
        "lease_ms": 0,
    }
    assert P.validate_request(body) is body
    assert P.validate_request({**body, "use": False})["use"] is False
    with pytest.raises(ProtocolViolation):
        P.validate_request({**body, "use": "no"})
    # unknown fields are ignored (spec §2), so older servers accept the flag
    assert P.validate_request({**body, "future_field": 1})["op"] == "fetch"


def test_bool_is_not_an_int_and_versions_are_checked() -> None:
    with pytest.raises(ProtocolViolation) as exc:
        P.validate_request({"v": True, "id": 1, "op": "stats", "s": b""})
    assert exc.value.code == P.MALFORMED
    with pytest.raises(ProtocolViolation) as exc:
        P.validate_request({"v": 2, "id": 1, "op": "stats", "s": b""})
    assert exc.value.code == P.UNSUPPORTED_VERSION


def test_codec_limits() -> None:
    codec = P.Codec(
        None, P.Limits(max_control_bytes=64, max_frame_bytes=16, max_message_bytes=24, max_keys=4)
    )
    ok = codec.encode({"v": 1, "id": 1}, [b"a" * 8, b"b" * 8], reply=True)
    body, data, authentic = codec.decode(ok, reply=True)
    assert body == {"v": 1, "id": 1} and [bytes(d) for d in data] == [b"a" * 8, b"b" * 8]
    assert authentic and ok[1] == b""
    cases = [
        ([msgpack.packb({"x": "y" * 100}), b""], P.TOO_LARGE),
        ([msgpack.packb({}), b"", b"z" * 17], P.TOO_LARGE),
        ([msgpack.packb({}), b"", b"z" * 16, b"z" * 16], P.TOO_LARGE),
        ([msgpack.packb({}), b"", *([b""] * 5)], P.TOO_LARGE),
        ([b"\xc1", b""], P.MALFORMED),
        ([msgpack.packb([1]), b""], P.MALFORMED),
        ([msgpack.packb({})], P.MALFORMED),
        (
            [msgpack.ExtType(1, b"x").data and msgpack.packb(msgpack.ExtType(1, b"x")), b""],
            P.MALFORMED,
        ),
    ]
    for frames, code in cases:
        with pytest.raises(ProtocolViolation) as exc:
            codec.decode(frames, reply=False)
        assert exc.value.code == code


def test_mac_covers_body_data_and_direction() -> None:
    codec = P.Codec(b"secret")
    frames = codec.encode({"v": 1, "id": 2}, [b"chunk"], reply=True)
    assert len(frames[1]) == P.TAG_BYTES
    assert codec.decode(frames, reply=True)[2]
    assert not codec.decode(frames, reply=False)[2]
    assert not codec.decode([frames[0], b"", frames[2]], reply=True)[2]
    assert not codec.decode([frames[0], frames[1], b"chunk!"], reply=True)[2]
    unsigned = codec.encode({"v": 1, "id": 2, "ok": False}, reply=True, sign=False)
    assert unsigned[1] == b"" and not codec.decode(unsigned, reply=True)[2]


def test_secret_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(P.SECRET_ENV, "from-env")
    assert P.secret_from(None) == b"from-env"
    assert P.secret_from(None, use_env=False) is None
    assert P.secret_from("given") == b"given"
    with pytest.raises(ConfigError):
        P.secret_from("")


def test_boolean_ids_and_out_of_grammar_fields_are_malformed() -> None:
    stats = {"v": 1, "id": 1, "op": "stats", "s": b"s" * P.SESSION_BYTES}
    assert P.validate_request(stats) is stats
    for broken in ({"id": True}, {"id": False}, {"s": b"s" * 15}):
        with pytest.raises(ProtocolViolation) as exc:
            P.validate_request({**stats, **broken})
        assert exc.value.code == P.MALFORMED
    listing = {**stats, "op": "list", "namespace": KEYS[0].namespace, "after": None, "limit": 1}
    assert P.validate_request(listing) is listing
    for namespace in ("../" + KEYS[0].namespace, KEYS[0].namespace.upper(), "", "/"):
        with pytest.raises(ProtocolViolation) as exc:
            P.validate_request({**listing, "namespace": namespace})
        assert exc.value.code == P.MALFORMED


def test_keys_over_the_limit_are_refused_by_the_schema() -> None:
    body = {"v": 1, "id": 1, "op": "lookup", "s": b"s" * 16, "keys": P.pack_keys(KEYS)}
    assert P.validate_request(body, P.Limits(max_keys=3)) is body
    with pytest.raises(ProtocolViolation) as exc:
        P.validate_request(body, P.Limits(max_keys=2))
    assert exc.value.code == P.TOO_LARGE


def test_spec_and_code_agree_on_error_codes_and_field_grammar() -> None:
    spec = (Path(__file__).resolve().parents[2] / "spec" / "PROTOCOL.md").read_text()
    errors = spec[spec.index("## 7. Errors") : spec.index("## 8.")]
    assert set(re.findall(r"^\| `(\w+)` \|", errors, re.MULTILINE)) == P.ERROR_CODES
    grammar = spec[spec.index("**Field grammar.**") : spec.index("Rules:")]
    assert set(re.findall(r"^\| `(\w+)` \|", grammar, re.MULTILINE)) == set(P.FIELD_GRAMMAR)
    for bound in (
        P.MAX_CLIENT_NAME_BYTES,
        P.MAX_HELLO_LIST,
        P.MAX_PLANE_NAME_CHARS,
        P.MAX_NIXL_METADATA_BYTES >> 10,
    ):
        assert str(bound) in grammar


def test_a_tp_reserve_names_its_engine_in_at_most_64_bytes() -> None:
    reserve = {
        "v": 1,
        "id": 1,
        "op": "reserve",
        "s": b"s" * P.SESSION_BYTES,
        "keys": P.pack_keys(KEYS[:1]),
        "plane": P.PLANE_SHM,
        "mode": "if_absent",
        "tp": 2,
        "rank": 1,
        "parents": b"p" * 32,
        "tokens": [b"\0" * 4],
    }
    assert P.validate_request(reserve) is reserve  # a 1.0 client names none
    named = {**reserve, "engine": b"e" * P.MAX_ENGINE_ID_BYTES}
    assert P.validate_request(named) is named
    for engine in (b"", b"e" * (P.MAX_ENGINE_ID_BYTES + 1), "engine-a"):
        with pytest.raises(ProtocolViolation) as exc:
            P.validate_request({**reserve, "engine": engine})
        assert exc.value.code == P.MALFORMED
