"""API keys map to tenants; without keys, auth is off."""

import pytest

from infx.auth import ANONYMOUS, KeyFileError, KeyStore


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
    assert store.client("bearer sk-admin").admin
    assert store.engine("Bearer ek-b").tenant == "team-b"


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
