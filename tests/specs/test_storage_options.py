"""storage_options (credentials by reference only) and URL masking in JSON dumps."""

from __future__ import annotations

import re

import pytest

from e31.specs import JobSpec, SpecError, is_credential_key, json_schema, parse_spec, reference_of, secrets_in, spec_payload

jsonschema = pytest.importorskip("jsonschema")

SIGNED = "https://h/x?X-Amz-Signature=abc123"
SPEC = f"""
name: job
work: {{kind: training, entrypoint: pkg.mod:main}}
data:
  - name: d
    url: '{SIGNED}'
    storage_options: {{endpoint_url: 'http://minio:9000', key: {{env: AWS_KEY}}, secret: {{secret: s3-creds}}}}
request: {{limit: 30m}}
output:
  kind: results
  url: 's3://b/out/'
  files: [m.json]
  storage_options:
    client_kwargs: {{endpoint_url: 'http://minio:9000', region_name: eu-west-1}}
    credentials: {{secret: gcs-sa}}
    anon: false
    headers: [{{env: HEADER_1}}, plain]
  checkpoint: {{url: 's3://t0k3n@b/ck/', storage_options: {{aws_session_token: {{env: AWS_SESSION_TOKEN}}}}}}
"""


def test_valid_storage_options_everywhere():
    spec = parse_spec(SPEC)
    assert spec.data[0].storage_options == {
        "endpoint_url": "http://minio:9000", "key": {"env": "AWS_KEY"}, "secret": {"secret": "s3-creds"},
    }
    assert spec.output.storage_options["credentials"] == {"secret": "gcs-sa"}
    assert spec.output.storage_options["headers"] == [{"env": "HEADER_1"}, "plain"]
    assert spec.output.checkpoint.storage_options == {"aws_session_token": {"env": "AWS_SESSION_TOKEN"}}


def test_storage_options_default_and_empty():
    head = "name: j\nwork: {kind: training, entrypoint: a:b}\nrequest: {limit: 1m}\n"
    plain = parse_spec(head + "output: {kind: results, url: /o, files: [m]}\n")
    assert plain.output.storage_options == {} and plain.output.checkpoint.storage_options == {}
    empty = parse_spec(head + "data:\n  - name: d\n    url: /x\n    storage_options:\n"
                       "output: {kind: results, url: /o, files: [m]}\n")
    assert empty.data[0].storage_options == {}


def test_literal_secret_is_refused_without_echoing_it():
    text = SPEC.replace("secret: {secret: s3-creds}", "secret: abc-planted")
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="job.yaml")
    assert [str(p) for p in info.value.problems] == [
        "data[0].storage_options.secret: a credential written into the spec would be stored in Prefect parameters "
        "and shown in logs (got a literal value); use {secret: BLOCK_NAME} (a Prefect Secret block) or {env: VAR_NAME}, "
        "or leave it out and set the store's standard environment variables (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
        "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY)",
    ]
    assert "abc" not in str(info.value)


def test_python_validation_error_does_not_echo_the_literal():
    data = parse_spec(SPEC).model_dump()
    data["output"]["storage_options"] = {"client_kwargs": {"aws_secret_access_key": "abc-planted"}}
    with pytest.raises(SpecError) as info:
        JobSpec.model_validate(data)
    assert "abc" not in str(info.value)
    assert [p.path for p in info.value.problems] == ["output.storage_options.client_kwargs.aws_secret_access_key"]


@pytest.mark.parametrize(("key", "credential"), [
    ("secret", True), ("client_secret", True), ("Password", True), ("passwd", True), ("token", True),
    ("aws_session_token", True), ("credentials", True), ("sas_token", True), ("account_key", True),
    ("connection_string", True), ("private_key", True), ("key", True), ("KEY", True), ("aws_access_key_id", True),
    ("aws_secret_access_key", True), ("endpoint_url", False), ("region_name", False), ("anon", False),
    ("project", False), ("account_name", False), ("key_prefix", False), ("client_kwargs", False), (3, False),
    # normalised: case, '_' and '-' do not matter
    ("api_key", True), ("apikey", True), ("API-Key", True), ("apiKey", True), ("access_key", True), ("accessKey", True),
    ("access_key_id", True), ("AccessKeyId", True), ("secret_key", True), ("secret_access_key", True),
    ("client-secret", True), ("session_token", True), ("SAS", True), ("Account-Key", True), ("connectionString", True),
    ("credential", True), ("private-key", True), ("PWD", True), ("auth", True), ("Authorization", True),
    ("cookies", True), ("headers", False), ("sse_kms_key_id", False), ("requester_pays", False),
    ("default_block_size", False), ("version_aware", False), ("has_assets", False), ("keys", False),
    # SSH/SFTP and token names are credentials; paths to credential files are not
    ("passphrase", True), ("pkey", True), ("bearer", True), ("bearer_token", True), ("jwt", True),
    ("token_file", False), ("key_file", False), ("credentials_path", False), ("private_key_filename", False),
])
def test_credential_keys(key, credential):
    assert is_credential_key(key) is credential


@pytest.mark.parametrize(("name", "credential"), [
    ("Authorization", True), ("authorization", True), ("Proxy-Authorization", True), ("Cookie", True),
    ("Set-Cookie", True), ("X-Api-Key", True), ("X-Auth-Token", True), ("X-Amz-Security-Token", True),
    ("Ocp-Apim-Subscription-Key", True), ("X-Secret", True), ("x_password", True),
    ("Accept", False), ("Content-Type", False), ("User-Agent", False), ("Range", False), ("Keep-Alive", False),
    ("X-Amz-Content-Sha256", False), (None, False),
])
def test_credential_header_names(name, credential):
    from e31.specs.credential_keys import is_credential_header

    assert is_credential_header(name) is credential


def test_references_and_plain_headers_are_accepted():
    options = (
        "{headers: {Authorization: {env: MY_TOKEN}, Accept: text/csv, X-Request-Id: '42'}, "
        "client_kwargs: {headers: {X-Api-Key: {secret: api-key}, Cookie: {env: COOKIE}}}, "
        "default_headers: [[Authorization, {env: MY_TOKEN}], [Accept, '*/*']], "
        "api_key: {env: API_KEY}, accessKey: {secret: s3-creds}, password: null, token: false}"
    )
    spec = parse_spec(f"""
name: job
work: {{kind: training, entrypoint: pkg.mod:main}}
data: [{{name: d, url: 'https://h/x.csv', storage_options: {options}}}]
request: {{limit: 30m}}
output: {{kind: results, url: /o, files: [m.json]}}
""")
    got = spec.data[0].storage_options
    assert got["headers"] == {"Authorization": {"env": "MY_TOKEN"}, "Accept": "text/csv", "X-Request-Id": "42"}
    assert got["client_kwargs"]["headers"] == {"X-Api-Key": {"secret": "api-key"}, "Cookie": {"env": "COOKIE"}}
    assert got["default_headers"] == [["Authorization", {"env": "MY_TOKEN"}], ["Accept", "*/*"]]
    assert got["api_key"] == {"env": "API_KEY"} and got["accessKey"] == {"secret": "s3-creds"}


def test_bad_reference_in_a_header_names_its_path():
    data = parse_spec(SPEC).model_dump()
    data["data"][0]["storage_options"] = {"client_kwargs": {"headers": {"Authorization": {"env": "1BAD"}}}}
    with pytest.raises(SpecError) as info:
        JobSpec.model_validate(data)
    assert [p.path for p in info.value.problems] == ["data[0].storage_options.client_kwargs.headers.Authorization.env"]


@pytest.mark.parametrize(("value", "ref"), [
    ({"secret": "s3-creds"}, ("secret", "s3-creds")), ({"env": "AWS_KEY"}, ("env", "AWS_KEY")),
    ({"secret": ""}, None), ({"secret": 5}, None), ({"secret": "a", "env": "b"}, None), ({"secret": "Up"}, None),
    ({"env": "1A"}, None), ("secret", None), ({"other": "x"}, None),
])
def test_reference_of(value, ref):
    assert reference_of(value) == ref


def test_url_fields_are_masked_in_json_mode_only():
    from fastapi.encoders import jsonable_encoder

    spec = parse_spec(SPEC)
    encoded = jsonable_encoder(spec)  # what Prefect stores as the flow run's parameters
    assert encoded["data"][0]["url"] == "https://h/x?X-Amz-Signature=***"
    assert encoded["output"]["checkpoint"]["url"] == "s3://***@b/ck/"
    assert encoded["output"]["url"] == "s3://b/out/"
    assert spec.data[0].url == SIGNED
    assert JobSpec.model_validate(spec).data[0].url == SIGNED
    assert spec.model_dump()["data"][0]["url"] == SIGNED
    assert "abc123" not in spec.model_dump_json() and "t0k3n" not in spec.model_dump_json()
    revealed = spec.model_dump(mode="json", context={"reveal_secrets": True})
    assert revealed["data"][0]["url"] == SIGNED


def test_spec_payload_and_secrets_in():
    spec = parse_spec(SPEC)
    assert spec_payload(spec, reveal=False) == spec.model_dump(mode="json")
    shown = spec_payload(spec, reveal=False)
    assert shown["data"][0]["url"] == "https://h/x?X-Amz-Signature=***"
    real = spec_payload(spec, reveal=True)
    assert real["data"][0]["url"] == SIGNED and real["output"]["checkpoint"]["url"] == "s3://t0k3n@b/ck/"
    assert JobSpec.model_validate(real) == spec
    assert real["output"]["storage_options"] == shown["output"]["storage_options"]  # references are not secret
    assert secrets_in(spec) == ["data[0].url", "output.checkpoint.url"]
    assert secrets_in(parse_spec(SPEC.replace(SIGNED, "/data/x").replace("t0k3n@", ""))) == []


def test_schema_describes_storage_options():
    schema = json_schema()
    defs = schema["$defs"]
    for model in ("DataInput", "OutputSpec", "CheckpointPolicy"):
        prop = defs[model]["properties"]["storage_options"]
        assert prop["type"] == "object" and prop["title"] == "Storage Options" and prop["description"]
        refs = prop["additionalProperties"]["anyOf"]
        assert [r.get("required") for r in refs[:2]] == [["secret"], ["env"]]
    validator = jsonschema.Draft202012Validator(schema)
    base = {"name": "j", "work": {"kind": "training", "entrypoint": "a:b"}, "request": {"limit": "1m"},
            "output": {"kind": "results", "url": "/o", "files": ["m"]}}
    for options, ok in [
        ({"endpoint_url": "http://m:9000", "key": {"env": "K"}, "secret": {"secret": "s3-creds"},
          "client_kwargs": {"region_name": "eu"}, "anon": True}, True),
        ({"key": {"secret": 5}}, False), ({"key": {"secret": "a", "env": "b"}}, False), ({"key": {"secret": ""}}, False),
        ({"key": {"env": "1A"}}, False),
        # literals under credential keys: refused by the schema too (a Prefect server checks run parameters with it)
        ({"secret": "literal-pw"}, False), ({"Secret-Access-Key": "x"}, False), ({"aws_access_key_id": 1}, False),
        ({"token": "anon", "password": None, "use_token": True, "token_file": "/run/t"}, True),
        ({"key_prefix": "a/", "endpoint_url": "http://x"}, True),
        ({"headers": {"Authorization": "Bearer x"}}, False), ({"headers": {"X-Api-Key": "k"}}, False),
        ({"client_kwargs": {"headers": {"Cookie": "s=1"}}}, False),
        ({"headers": {"Authorization": {"env": "TOKEN"}, "Accept": "text/csv"},
          "client_kwargs": {"headers": {"Cookie": {"secret": "c"}}, "trust_env": True}}, True),
    ]:
        assert validator.is_valid({**base, "output": {**base["output"], "storage_options": options}}) is ok, options


@pytest.mark.parametrize("mode", ["anon", "google_default", "cache", "cloud", "browser"])
def test_gcsfs_token_modes_are_not_secrets(mode):
    """gcsfs's token: anon (public buckets) and the other modes name how to
    authenticate; any other literal token is still refused."""
    from e31.specs import SpecError, parse_spec

    spec = {"name": "gcs", "work": {"kind": "processing", "command": ["true"]}, "request": {"limit": "1m"},
            "output": {"kind": "results", "url": "gs://bkt/out/", "files": ["r.txt"], "storage_options": {"token": mode}}}
    assert parse_spec(spec).output.storage_options == {"token": mode}
    spec["output"]["storage_options"] = {"token": "ya29.literal-oauth-token"}
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert "ya29" not in str(info.value) and str(info.value.problems[0]).startswith("output.storage_options.token: ")


@pytest.mark.parametrize("key", [
    "key", "KEY", "secret", "Secret_Access_Key", "aws_access_key_id", "accessKey", "api-key", "sas_token", "sas",
    "auth", "pwd", "pkey", "jwt", "client_secret", "connection_string", "passphrase", "Authorization", "my key",
    "token_file", "credentials_path", "sas_token_file", "key_prefix", "endpoint_url", "client_kwargs", "anon",
    "region_name", "account_name", "keys", "monkey", "keyfile", "tokenfilename", "use_ssl",
])
def test_schema_credential_key_pattern_agrees_with_is_credential_key(key):
    """The JSON Schema pattern (JavaScript/Python regex, no flags) and the
    validator's rule name the same keys."""
    from e31.specs.storage_options import CREDENTIAL_KEY_PATTERN, is_credential_key

    assert bool(re.search(CREDENTIAL_KEY_PATTERN, key)) is is_credential_key(key)



@pytest.mark.parametrize("name", [
    "Authorization", "Proxy-Authorization", "Cookie", "X-Api-Key", "X-Auth-Token", "X-Amz-Security-Token",
    "Ocp-Apim-Subscription-Key", "bearer", "Accept", "User-Agent", "Range", "Content-Type", "If-None-Match",
])
def test_schema_credential_header_pattern_agrees_with_is_credential_header(name):
    from e31.specs.credential_keys import is_credential_header
    from e31.specs.storage_options import CREDENTIAL_HEADER_PATTERN

    assert bool(re.search(CREDENTIAL_HEADER_PATTERN, name)) is is_credential_header(name)
