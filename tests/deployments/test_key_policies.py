"""kvserve.deployments.limits' key policies (policies.py): a key file's lines and their attributes, parse
errors that name the line but never the key, and the lookup that compares every key. Fast (no Ray,
no model)."""

import hashlib

import pytest

from kvserve.deployments.limits import policies
from kvserve.deployments.limits import (
    KeyPolicy,
    find_policy,
    load_key_file,
    parse_key_lines,
    policies_from_keys,
)

pytestmark = pytest.mark.timeout(60)


SECRET = "sk-Secret-Value-123"


def test_parse_attributes_and_old_format():
    ps = parse_key_lines(
        [
            "# a comment",
            "",
            "   ",
            "sk-plain",
            f"{SECRET}  name=team-a  rpm=60 tpm=2.5e4 priority=-2   # trailing comment",
            "sk-inf rpm=inf tpm=0",
        ]
    )
    assert [p.key for p in ps] == ["sk-plain", SECRET, "sk-inf"]
    plain, a, inf = ps
    assert plain.name == "key-" + hashlib.sha256(b"sk-plain").hexdigest()[:8]
    assert (plain.requests_per_minute, plain.tokens_per_minute, plain.priority) == (None, None, 0)
    assert (a.name, a.requests_per_minute, a.tokens_per_minute, a.priority) == ("team-a", 60.0, 25000.0, -2)
    assert inf.requests_per_minute == float("inf") and inf.tokens_per_minute == 0.0


def test_policies_from_keys_accepts_plain_and_attributed_entries():
    ps = policies_from_keys(["k1", "", "k2 name=ci rpm=5"])
    assert [(p.key, p.requests_per_minute) for p in ps] == [("k1", None), ("k2", 5.0)]
    assert ps[1].name == "ci"
    with pytest.raises(ValueError, match="entry 2"):
        policies_from_keys(["k1", "k2 rpm=x"])


def test_key_never_in_repr():
    p = KeyPolicy(SECRET, name="x")
    assert SECRET not in repr(p) and SECRET not in str(p)
    assert "name='x'" in repr(p)


@pytest.mark.parametrize(
    "line, needle",
    [
        (f"{SECRET} rpm=abc", "rpm="),
        (f"{SECRET} rpm=-1", "rpm="),
        (f"{SECRET} tpm=nan", "tpm="),
        (f"{SECRET} priority=1.5", "priority="),
        (f"{SECRET} color=red", "unknown attribute"),
        (f"{SECRET} tail-of-a-key-with-a-space", "unknown attribute"),
        (f"{SECRET} rpm=1 rpm=2", "twice"),
        (f"{SECRET} name=bad!name", "name="),
        (f"rpm=5 {SECRET}", "key must come first"),
    ],
)
def test_parse_errors_name_the_line_not_the_key(line, needle):
    with pytest.raises(ValueError) as ei:
        parse_key_lines(["sk-first", "# c", line])
    msg = str(ei.value)
    assert "line 3" in msg and needle in msg
    assert SECRET not in msg and "Secret" not in msg and "tail-of" not in msg


def test_duplicates_rejected():
    with pytest.raises(ValueError, match="line 3: duplicate key") as ei:
        parse_key_lines([SECRET, "other", f"{SECRET} name=z"])
    assert SECRET not in str(ei.value)
    with pytest.raises(ValueError, match="line 2: duplicate name 'a'"):
        parse_key_lines(["k1 name=a", "k2 name=a"])
    # a given name equal to another key's derived name is a duplicate too
    derived = KeyPolicy("k1").name
    with pytest.raises(ValueError, match="duplicate name"):
        parse_key_lines(["k1", f"k2 name={derived}"])


def test_load_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# keys\nsk-a rpm=10\nsk-b\n")
    assert [p.key for p in load_key_file(f)] == ["sk-a", "sk-b"]
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no keys"):
        load_key_file(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read"):
        load_key_file(tmp_path / "missing")
    (tmp_path / "bin").write_bytes(b"sk-\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_key_file(tmp_path / "bin")
    (tmp_path / "bad").write_text(f"sk-a\n{SECRET} rpm=oops\n")
    with pytest.raises(ValueError, match="line 2") as ei:
        load_key_file(tmp_path / "bad")
    assert SECRET not in str(ei.value) and str(tmp_path / "bad") in str(ei.value)


def test_find_policy():
    ps = policies_from_keys(["alpha", "beta", "gamma"])
    assert find_policy(b"beta", ps) is ps[1]
    assert find_policy(b"gamma", ps) is ps[2]  # the last key matches too (no early-exit bug)
    assert find_policy("alpha", ps) is ps[0]
    assert find_policy(b"bet", ps) is None
    assert find_policy(b"betaa", ps) is None
    assert find_policy(b"", ps) is None
    assert find_policy(b"\xff\xfe\x00caf\xc3\xa9", ps) is None  # non-ASCII, invalid UTF-8: no error
    uni = policies_from_keys(["café-ключ"])
    assert find_policy("café-ключ".encode(), uni) is uni[0]
    assert find_policy(b"", [KeyPolicy("", name="anon")]) is None  # an empty key never matches


def test_find_policy_checks_every_key(monkeypatch):
    calls = []
    real = policies.hmac.compare_digest

    def spy(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(policies.hmac, "compare_digest", spy)
    ps = policies_from_keys(["k1", "k2", "k3"])
    assert find_policy(b"k1", ps) is ps[0]
    assert calls == [b"k1", b"k2", b"k3"]
