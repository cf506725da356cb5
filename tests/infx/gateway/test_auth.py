"""API keys map to tenants; without keys, auth is off."""

import pytest

from infx.gateway.auth import ANONYMOUS, KeyFileError, KeyStore


def test_without_keys_everyone_is_the_default_tenant():
    store = KeyStore.disabled()
    assert store.client(None) is ANONYMOUS
    assert store.engine("Bearer whatever") is ANONYMOUS


def test_keys_from_a_mounted_secret_file_map_to_tenants(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n"
        "  - {key: sk-a, tenant: team-a, rate_limit: {rate: 2, burst: 4}}\n"
        "  - {key: sk-admin, tenant: team-a, admin: true}\n"
        "engine_keys:\n"
        "  - {key: ek-b, tenant: team-b}\n"
    )
    store = KeyStore.from_file(str(path))
    client = store.client("Bearer sk-a")
    assert client.tenant == "team-a" and not client.admin
    assert (client.rate_limit.rate, client.rate_limit.burst) == (2.0, 4)
    assert store.client("bearer sk-admin").admin and not store.client("bearer sk-admin").cluster_admin
    assert store.engine("Bearer ek-b").tenant == "team-b"


def test_admin_cluster_is_the_one_admin_of_every_tenant_and_auth_off_is_one_too():
    store = KeyStore.from_mapping({"keys": [{"key": "sk-ops", "tenant": "ops", "admin": "cluster"},
                                            {"key": "sk-a", "tenant": "team-a", "admin": True}]})
    ops, team_a = store.client("Bearer sk-ops"), store.client("Bearer sk-a")
    assert (ops.admin, ops.cluster_admin, team_a.admin, team_a.cluster_admin) == (True, True, True, False)
    assert ANONYMOUS.cluster_admin  # no key file: everything is open, and the gateway says so at start


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic sk-a", "Bearer sk-unknown", "Bearer ek-b"])
def test_missing_malformed_or_unknown_keys_are_refused(header):
    store = KeyStore.from_mapping({"keys": [{"key": "sk-a"}], "engine_keys": [{"key": "ek-b"}]})
    assert store.client(header) is None


@pytest.mark.parametrize(
    "data,message",
    [
        ([], "expected a mapping"),
        ({"users": []}, "unknown sections"),
        ({"keys": [{"tenant": "x"}]}, "needs a non-empty 'key'"),
        ({"keys": [{"key": "a"}, {"key": "a"}]}, "duplicate key"),
        ({"keys": [{"key": "a", "rate_limit": {"rate": 0}}]}, "rate_limit"),
    ],
)
def test_malformed_key_files_are_refused(data, message):
    with pytest.raises(KeyFileError, match=message):
        KeyStore.from_mapping(data)


# --- the strict schema (pure: text in, tables out) -------------------------------------------------

from infx.gateway.auth import KeyTables, key_fingerprint, parse_key_file  # noqa: E402


@pytest.mark.parametrize(
    "text,message",
    [
        ("keys:\n  - {key: sk-a, tenat: team-a}\n", r"keys\[0\]: unknown member 'tenat'"),
        ("keys:\n  - {key: sk-a, admn: true}\n", r"keys\[0\]: unknown member 'admn'"),
        ("keys:\n  - {key: sk-a, admin: 'false'}\n",
         r"'admin' must be true or false \(unquoted\), or cluster, got 'false'"),
        ("keys:\n  - {key: sk-a, admin: clusters}\n", r"or cluster, got 'clusters'"),
        ("keys:\n  - {key: sk-a, admin: 1}\n", "'admin' must be true or false"),
        ("keys:\n  - {key: sk-a, rate_limit: 5}\n", r"rate_limit must be a mapping \{rate: R, burst: B\}.*got 5"),
        ("keys:\n  - {key: sk-a, rate_limit: {rate: -1}}\n", "rate -1 is not a positive number"),
        ("keys:\n  - {key: sk-a, rate_limit: {rate: '5'}}\n", "rate '5' is not a positive number"),
        ("keys:\n  - {key: sk-a, rate_limit: {rate: .inf}}\n", "rate inf is not a positive number"),
        ("keys:\n  - {key: sk-a, rate_limit: {rate: 5, burst: 0}}\n", "burst 0 is not a whole number"),
        ("keys:\n  - {key: sk-a, rate_limit: {rate: 5, burst: 2.5}}\n", "burst 2.5 is not a whole number"),
        ("keys:\n  - {key: sk-a, rate_limit: {rate: 5, brust: 9}}\n", "rate_limit must be a mapping"),
        ("keys:\n  - {key: sk-a, rate_limit: {burst: 9}}\n", "rate_limit must be a mapping"),
        ("keys:\n  - {key: sk-a}\n  - {key: sk-a}\n", r"keys\[1\]: duplicate key \(also keys\[0\]\)"),
        ("keys:\n  - key: sk-a\n    key: sk-b\n", "'key' is given twice in one mapping"),
        ("keys: []\nkeys: []\n", "'keys' is given twice"),
        ("keys:\n  - {key: 12345}\n", "needs a non-empty 'key' string"),
        ("keys:\n  - {key: 'sk a'}\n", "must not contain white space"),
        ("keys:\n  - {key: sk-a, tenant: 7}\n", "'tenant' must be a non-empty string"),
        ("keys:\n  - {key: sk-a, name: [x]}\n", "'name' must be a non-empty string"),
        ("engine_keys:\n  - {key: ek-a, admin: true}\n", r"engine_keys\[0\]: unknown member 'admin'"),
        ("engine_keys:\n  - {key: ek-a, tenat: b}\n", r"engine_keys\[0\]: unknown member 'tenat'"),
        ("engine_keys: {key: ek-a}\n", "'engine_keys' must be a list"),
        ("keys:\n  - sk-a\n", r"keys\[0\]: expected a mapping"),
        ("keys: [\n", "not valid YAML: line 2, column 1"),
    ],
)
def test_the_schema_is_strict_and_says_what_is_wrong_in_one_line(text, message):
    with pytest.raises(KeyFileError, match=message) as refused:
        parse_key_file(text, "keys.yaml")
    assert "\n" not in str(refused.value) and str(refused.value).startswith(("keys.yaml", "API key file keys.yaml"))


def test_a_well_formed_file_parses_with_defaults():
    tables = parse_key_file(
        "keys:\n"
        "  - {key: sk-a, tenant: team-a, name: ci, rate_limit: {rate: 2.5}, admin: false}\n"
        "  - {key: sk-b}\n"
        "engine_keys:\n"
        "  - {key: ek-a, tenant: team-a}\n", "keys.yaml")
    ci = tables.clients["sk-a"]
    assert (ci.tenant, ci.key_id, ci.admin, ci.rate_limit.rate, ci.rate_limit.burst) == ("team-a", "ci", False, 2.5, 2)
    other = tables.clients["sk-b"]
    assert (other.tenant, other.key_id, other.admin, other.rate_limit) == ("default", key_fingerprint("sk-b"), False,
                                                                           None)
    assert "sk-b" not in other.key_id
    assert tables.engines["ek-a"].tenant == "team-a"


def test_a_key_file_without_keys_keeps_auth_on_and_refuses_everyone():
    store = KeyStore(parse_key_file("keys: []\n"))
    assert store.enabled
    assert store.client("Bearer anything") is None and store.engine("Bearer anything") is None


def test_replacing_the_tables_revokes_removed_keys_and_keeps_the_builtin_engine_key():
    from infx.gateway.auth import Principal

    store = KeyStore(parse_key_file("keys:\n  - {key: sk-a}\n  - {key: sk-b}\n"))
    store.add_engine_key("ek-builtin", Principal(tenant="default", key_id="builtin-echo"))
    store.replace(parse_key_file("keys:\n  - {key: sk-b, tenant: t}\n"))
    assert store.client("Bearer sk-a") is None
    assert store.client("Bearer sk-b").tenant == "t"
    assert store.engine("Bearer ek-builtin").key_id == "builtin-echo"
    with pytest.raises(ValueError):
        KeyStore.disabled().replace(KeyTables({}, {}))


from hypothesis import given, settings, strategies as st  # noqa: E402

_yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
                          st.text(max_size=6), st.just("false"))
_members = st.sampled_from(["key", "tenant", "name", "admin", "rate_limit", "tenat", "rate", "burst"])
_values = st.recursive(_yaml_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                              st.dictionaries(_members, inner, max_size=4)),
                       max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["keys", "engine_keys", "users"]), _values, max_size=2))
def test_any_key_file_parses_to_valid_principals_or_is_refused_with_one_line(data):
    import yaml

    try:
        tables = parse_key_file(yaml.safe_dump(data), "keys.yaml")
    except KeyFileError as e:
        assert "\n" not in str(e)
        return
    for principal in [*tables.clients.values(), *tables.engines.values()]:
        assert isinstance(principal.admin, bool) and isinstance(principal.tenant, str) and principal.tenant
        if principal.rate_limit is not None:
            assert principal.rate_limit.rate > 0 and principal.rate_limit.burst >= 1
    assert not any(p.admin for p in tables.engines.values())
