"""The ``s3_server`` fixture is a real, credential-enforcing S3 endpoint and
its environment reaches clients that get no explicit arguments."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import fsspec
import pytest
import s3fs


def test_roundtrip_bytes_and_single_put_etag(s3_server, s3_prefix):
    fs = s3_server.filesystem()
    data = os.urandom(1 << 20) + b"tail"  # 1 MiB + 4 B: one PUT
    path = s3_prefix + "blob.bin"
    fs.pipe(path, data)

    assert fs.cat(path) == data
    info = fs.info(path)
    assert info["size"] == len(data)
    assert info["ETag"].strip('"') == hashlib.md5(data).hexdigest()
    assert fs.find(s3_prefix) == [path.removeprefix("s3://")]


@pytest.mark.parametrize("wrong, code", [("secret", "SignatureDoesNotMatch"), ("key", "InvalidAccessKeyId")])
def test_wrong_credentials_are_refused(s3_server, s3_prefix, wrong, code):
    key = s3_server.key + ("-wrong" if wrong == "key" else "")
    secret = s3_server.secret + ("-wrong" if wrong == "secret" else "")
    fs = s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": s3_server.endpoint},
                           skip_instance_cache=True)
    fs.retries = 1
    with pytest.raises(PermissionError) as err:  # s3fs maps the ClientError; the code is in its cause
        fs.ls(s3_server.bucket, refresh=True)
    assert code in repr(err.value.__cause__)
    with pytest.raises(PermissionError):
        fs.pipe(s3_prefix + "denied.bin", b"x")
    assert not s3_server.filesystem().exists(s3_prefix + "denied.bin")


def test_environment_alone_reaches_the_server(s3_server, s3_prefix):
    for name, value in s3_server.env().items():
        assert os.environ[name] == value
    s3_server.filesystem().pipe(s3_prefix + "env.txt", b"env")

    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # no key, secret or endpoint given
    assert s3_prefix.removeprefix("s3://").rstrip("/") in fs.ls(s3_server.bucket, refresh=True)
    assert fs.cat(s3_prefix + "env.txt") == b"env"

    # a subprocess started later inherits the same wiring
    code = "import fsspec, sys; print(fsspec.filesystem('s3').cat(sys.argv[1]).decode())"
    out = subprocess.run([sys.executable, "-c", code, s3_prefix + "env.txt"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "env"


def test_secret_stays_out_of_log_and_repr(s3_server):
    assert s3_server.secret not in repr(s3_server)
    assert s3_server.secret not in s3_server.log_path.read_text(errors="replace")
