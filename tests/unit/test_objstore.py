"""train/core/objstore.py without a server: URLs, the mirror, which mirror paths are the store's, endpoint checks.
The store against a real S3 server: tests/e2e/test_s3.py (long tier)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from train.core import objstore, sharedfs
from train.core.errors import ConfigError


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("EDT_S3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(objstore, "_stores", {})
    root = objstore.attach("s3://bucket/some/prefix", check=False)
    return root, objstore.store_for(root)


def test_url_split_and_bad_urls():
    assert objstore.split_url("s3://b/p/q/") == ("b", "p/q")
    assert objstore.split_url("s3://b") == ("b", "")
    assert objstore.is_url("S3://b/x") and not objstore.is_url("/nfs/s3:/b") and not objstore.is_url(None)
    for bad in ("s3://", "s3:///p", "s3://b/../x"):
        with pytest.raises(ConfigError, match="s3://BUCKET"):
            objstore.split_url(bad)


def test_the_mirror_is_per_endpoint_bucket_and_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("EDT_S3_CACHE", str(tmp_path))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")
    assert objstore.mirror_of("s3://b/runs") == tmp_path / "127.0.0.1_8333" / "b" / "runs"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert objstore.mirror_of("s3://b") == tmp_path / "s3.amazonaws.com" / "b"


def test_keys_and_which_paths_are_the_stores(store):
    root, st = store
    assert root.is_dir()  # made at attach: a fresh machine's listings start from it
    assert st.key(root) == "some/prefix"
    assert st.key(root / "run" / "rounds" / "r000001") == "some/prefix/run/rounds/r000001"
    assert st.url_of(root / "run" / "final") == "s3://bucket/some/prefix/run/final"
    assert objstore.store_for(root / "run" / "metrics.jsonl") is st
    # temp names, and everything in a temp folder, stay local: published by a rename, never uploaded as they are
    assert objstore.store_for(root / "run" / ".metrics.jsonl.tmp-1") is None
    assert objstore.store_for(root / "run" / ".global.tmp-1-ab" / "model.safetensors") is None
    assert objstore.mirror_store(root / "run" / ".global.tmp-1-ab" / "model.safetensors") is st
    assert objstore.store_for(Path(os.fspath(root) + "x") / "f") is None  # a sibling folder is not the mirror
    assert objstore.where(root / "run" / "final").startswith("s3://bucket/some/prefix/run/final (local copy: ")
    assert sharedfs.locks_are_local(root / "run" / "coordinator.lock")
    assert not sharedfs.locks_are_local(root.parent / "elsewhere")


def test_open_fd_with_o_excl_on_the_store_is_refused(store):
    root, _ = store
    with pytest.raises(ValueError, match="create_new"):
        sharedfs.open_fd(root / "x.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)


@pytest.mark.parametrize("endpoint,ok", [("http://127.0.0.1:8333", True), ("http://localhost:9000", True),
                                         ("https://s3.example.com", True), ("http://[::1]:9000", True),
                                         ("http://10.0.0.5:9000", False), ("http://minio.lab:9000", False),
                                         ("ftp://x", False), ("not a url", False)])
def test_plain_http_only_to_loopback(monkeypatch, endpoint, ok):
    monkeypatch.delenv("EDT_S3_ALLOW_HTTP", raising=False)
    if ok:
        objstore._check_endpoint(endpoint)
    else:
        with pytest.raises(ConfigError, match="AWS_ENDPOINT_URL"):
            objstore._check_endpoint(endpoint)


def test_plain_http_off_loopback_when_the_network_is_trusted(monkeypatch):
    monkeypatch.setenv("EDT_S3_ALLOW_HTTP", "1")
    objstore._check_endpoint("http://10.0.0.5:9000")


def test_client_errors_map_to_what_the_protocol_expects(store):
    root, st = store

    class Fake(Exception):
        def __init__(self, code, status):
            super().__init__(code)
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    p = root / "run" / "x"
    assert isinstance(st._os_error(Fake("NoSuchKey", 404), p, "read"), FileNotFoundError)
    assert isinstance(st._os_error(Fake("PreconditionFailed", 412), p, "create"), FileExistsError)
    for code, status in (("SignatureDoesNotMatch", 403), ("InvalidAccessKeyId", 403), ("AccessDenied", 403)):
        err = st._os_error(Fake(code, status), p, "write")
        assert isinstance(err, ConfigError) and "AWS_ACCESS_KEY_ID" in str(err)
    err = st._os_error(Fake("NoSuchBucket", 404), p, "list")
    assert isinstance(err, ConfigError) and "'bucket' does not exist" in str(err)
    for code, status in (("SlowDown", 503), ("InternalError", 500), ("RequestTimeout", 400)):
        err = st._os_error(Fake(code, status), p, "write")
        assert type(err) is OSError and sharedfs.is_transient(err), code  # retried by sharedfs


def test_a_timeout_or_a_refused_connection_is_transient(store):
    """botocore's timeouts are OSErrors without an errno: mapped to EIO, which sharedfs retries (a frozen or
    restarting server is waited out), not passed through as a permanent error."""
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    root, st = store
    for e in (ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), ConnectTimeoutError(endpoint_url="http://x"),
              EndpointConnectionError(endpoint_url="http://127.0.0.1:9")):
        err = st._os_error(e, root / "run" / "x", "read")
        assert type(err) is OSError and sharedfs.is_transient(err), type(e).__name__
    local = OSError(28, "No space left on device")  # the mirror's own disk: as it is (a full disk is waited out)
    assert st._os_error(local, root / "run" / "x", "write") is local
