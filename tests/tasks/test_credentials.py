"""Resolving storage_options references on the worker, and redacting options for logs."""

from __future__ import annotations

import pytest

from e31.tasks.storage.credentials import CredentialError, redact, resolve_options


def test_env_references_resolve_at_any_depth(monkeypatch):
    monkeypatch.setenv("E31_TEST_KEY", "AKIA-planted")
    monkeypatch.setenv("E31_TEST_REGION", "eu-west-1")
    options = {
        "endpoint_url": "http://minio:9000",
        "key": {"env": "E31_TEST_KEY"},
        "client_kwargs": {"region_name": {"env": "E31_TEST_REGION"}},
        "headers": [{"env": "E31_TEST_KEY"}, "plain"],
        "anon": False,
    }
    resolved = resolve_options(options, "output.storage_options")
    assert resolved == {
        "endpoint_url": "http://minio:9000",
        "key": "AKIA-planted",
        "client_kwargs": {"region_name": "eu-west-1"},
        "headers": ["AKIA-planted", "plain"],
        "anon": False,
    }
    assert options["key"] == {"env": "E31_TEST_KEY"}  # not modified


def test_missing_env_variable(monkeypatch):
    monkeypatch.delenv("E31_TEST_UNSET", raising=False)
    with pytest.raises(CredentialError) as info:
        resolve_options({"client_kwargs": {"aws_secret_access_key": {"env": "E31_TEST_UNSET"}}}, "data[0].storage_options")
    assert str(info.value) == (
        "data[0].storage_options.client_kwargs.aws_secret_access_key: the environment variable E31_TEST_UNSET "
        "is not set on this worker; set it where the worker runs, e.g. export E31_TEST_UNSET=..."
    )
    assert isinstance(info.value, RuntimeError)


def test_malformed_reference_is_refused():
    with pytest.raises(CredentialError) as info:
        resolve_options({"key": {"secret": "a", "env": "B"}}, "output.storage_options")
    assert str(info.value) == (
        "output.storage_options.key: not a valid reference; write {secret: BLOCK_NAME} or {env: VAR_NAME}"
    )


def test_redact():
    options = {
        "endpoint_url": "https://minio:9000/?token=abc",
        "region_name": "eu-west-1",
        "key": "AKIA-planted",
        "Secret": "s3cr3t-planted",
        "token": {"secret": "gcs-token"},
        "client_kwargs": {"aws_session_token": "tok-planted", "endpoint_url": {"env": "URL"}, "verify": False},
        "credentials": {"type": "service_account", "private_key": "pk-planted"},
        "headers": [{"env": "H"}, "plain"],
        "anon": True,
        "count": 3,
    }
    assert redact(options) == {
        "endpoint_url": "https://minio:9000/?token=***",
        "region_name": "eu-west-1",
        "key": "***",
        "Secret": "***",
        "token": "***",
        "client_kwargs": {"aws_session_token": "***", "endpoint_url": "***", "verify": False},
        "credentials": "***",
        "headers": ["***", "plain"],
        "anon": True,
        "count": 3,
    }
    assert options["key"] == "AKIA-planted"  # not modified
    assert redact({}) == {}


def test_secret_block_references(prefect_api):
    from prefect.blocks.system import Secret

    Secret(value="s3cr3t-planted").save("e31-test-secret", overwrite=True)
    resolved = resolve_options({"secret": {"secret": "e31-test-secret"}, "client_kwargs": {"token": {"secret": "e31-test-secret"}}},
                               "output.storage_options")
    assert resolved == {"secret": "s3cr3t-planted", "client_kwargs": {"token": "s3cr3t-planted"}}

    with pytest.raises(CredentialError) as info:
        resolve_options({"key": {"secret": "e31-no-such-block"}}, "output.checkpoint.storage_options")
    assert str(info.value) == (
        "output.checkpoint.storage_options.key: the Prefect Secret block 'e31-no-such-block' does not exist on this "
        "Prefect server; create it with: prefect block create secret (then name it e31-no-such-block), "
        "or in Python: Secret(value=...).save('e31-no-such-block')"
    )
    assert "s3cr3t" not in str(info.value)


def test_empty_env_variable_is_named(monkeypatch):
    monkeypatch.setenv("E31_TEST_EMPTY", "")
    with pytest.raises(CredentialError) as info:
        resolve_options({"secret": {"env": "E31_TEST_EMPTY"}}, "data[1].storage_options")
    assert str(info.value) == ("data[1].storage_options.secret: the environment variable E31_TEST_EMPTY is set but "
                               "empty on this worker; give it the value, e.g. export E31_TEST_EMPTY=...")


def test_scrub_masks_credentials_and_secret_block_values_but_not_endpoints(prefect_api):
    """Store errors quote URLs and request parts: credentials (by key, and
    whatever a Secret block held, under any key) become ***, while the
    endpoint and region a user needs to debug stay readable."""
    from prefect.blocks.system import Secret

    from e31.tasks import storage

    Secret(value="block-value-under-odd-key").save("e31-test-scrub", overwrite=True)
    options = resolve_options({"endpoint_url": "http://127.0.0.1:21458", "key": "AKIAEXAMPLE42",
                               "profile": {"secret": "e31-test-scrub"},
                               "client_kwargs": {"region_name": "eu-west-2",
                                                 "headers": {"Authorization": "Bearer tok-123456"}}},
                              "output.storage_options")
    storage.use_options("s3://scrub-test", options)
    text = ('Could not connect to the endpoint URL: "http://127.0.0.1:21458/b/k" (eu-west-2) AKIAEXAMPLE42 '
            'Bearer tok-123456 block-value-under-odd-key')
    assert storage.scrub(text) == ('Could not connect to the endpoint URL: "http://127.0.0.1:21458/b/k" (eu-west-2) '
                                   '*** *** ***')


def test_uses_secret_blocks_only_for_secret_references():
    from e31.tasks.storage.credentials import uses_secret_blocks

    assert uses_secret_blocks({"secret": {"env": "X"}, "key": {"env": "Y"}}) is False
    assert uses_secret_blocks({"client_kwargs": {"headers": [{"secret": "b"}]}}) is True
    assert uses_secret_blocks(None) is False and uses_secret_blocks({}) is False
