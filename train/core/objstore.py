"""An object store (S3 and its dialects: AWS, R2, MinIO, Ceph, SeaweedFS's gateway) as BASE_DIR.

`base_dir = "s3://bucket/prefix"` maps the run onto objects `prefix/<project>/...` of `bucket`. The protocol code
does not know: it works on paths under a local **mirror** of the prefix (`$EDT_S3_CACHE`, default
~/.cache/edt/s3/<endpoint>/<bucket>/<prefix>), and train/core/sharedfs.py sends every call on a mirror path here.
What the protocol needs from its storage (DESIGN.md "Storage"), in its object-store form:

- **A file appears whole or not at all.** Writers write a temp file in the mirror (local, never uploaded) and
  publish it with `sharedfs.replace(tmp, final)`: here one PUT of the final key (multipart in parallel parts above
  `PART_BYTES`; a multipart upload is invisible until it completes, and one a crash leaves is never listed). A folder
  published by rename (`store.atomic_publish_dir`) uploads its files with MANIFEST.json last: readers trust a folder
  only with its manifest, as on a POSIX disk.
- **Create if absent** (markers, claims): a PUT with `If-None-Match: *` (`create_new`); a second creator gets
  FileExistsError. Conditional writes are checked when the store is attached (an S3 server that ignores them is
  refused with one line).
- **Consistent listings**: LIST (S3 has been strongly consistent since 2020; R2, MinIO and SeaweedFS too).
- **Nothing depends on fsync, O_DIRECT, renames of published objects, locks or mtimes**: fsync and O_DIRECT act on
  the local temp file only; an exclusive role is held by its lease (train/core/store.py exclusive_lock, `locks_are_
  local`).

Reads: `read_bytes` is one GET. `open_read` (sharedfs.open_fd for reading: safetensors, the token cache) downloads
the object into the mirror (parallel ranged GETs above PART_BYTES) unless the mirror already holds that version
(its ETag and the local file's inode in a sidecar `.<name>.etag`), and returns a descriptor of the local copy. A
listing of a folder drops mirror copies of objects the folder no longer holds (pruned rounds), so a worker's mirror
does not grow with the run.

Errors: a connection that fails or hangs (a read timeout), a 5xx and a throttle answer are OSError(EIO): transient
for sharedfs.retry, which waits them out for `outer.io_retry_s`. A missing key is FileNotFoundError. A bucket that
does not exist, credentials refused, no credentials, plain http to a host that is not loopback: ConfigError, one
line naming what to fix.

Credentials, region and endpoint come from the standard AWS variables and files (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL /
AWS_ENDPOINT_URL_S3, ~/.aws/config and credentials); nothing of them is logged.
"""
from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import logging
import os
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("objstore")

SCHEME = "s3://"
PART_BYTES = 16 << 20  # a transfer above this goes in parallel parts of this size
PARALLEL = 8           # parts in flight per transfer
REACH_S = 15.0         # how long a start waits for the endpoint to answer before it says it does not
MANIFEST = "MANIFEST.json"
ETAG_PREFIX = ".etag."  # the mirror's sidecar of a local copy: ETAG_PREFIX + name (never listed: a dot name)

_stores: dict[str, "ObjectStore"] = {}   # mirror root -> store
_lock = threading.Lock()


def is_url(value: Any) -> bool:
    return isinstance(value, str) and value.lower().startswith(SCHEME)


def cache_bytes() -> int:
    """How much of the mirror one process's downloads may take: $EDT_S3_CACHE_MB (default 4096 MB)."""
    return int(float(os.environ.get("EDT_S3_CACHE_MB") or 4096) * (1 << 20))


def cache_root() -> Path:
    return Path(os.path.expanduser(os.environ.get("EDT_S3_CACHE") or "~/.cache/edt/s3"))


def split_url(url: str) -> tuple[str, str]:
    """('bucket', 'prefix') of s3://bucket/prefix (the prefix without slashes at its ends; may be '')."""
    from train.core.errors import ConfigError

    rest = url[len(SCHEME):]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or any(c in bucket for c in " \\") or ".." in prefix.split("/"):
        raise ConfigError(f"base_dir: {url!r} is not an s3://bucket/prefix URL: give it as s3://BUCKET or "
                          f"s3://BUCKET/some/prefix")
    return bucket, prefix


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _check_endpoint(endpoint: str | None) -> None:
    """Plain http only to a loopback endpoint (credentials are signed, but every tensor would cross the network in
    the clear), unless EDT_S3_ALLOW_HTTP=1 says the network is trusted."""
    from train.core.errors import ConfigError

    if not endpoint:
        return
    u = urlparse(endpoint)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"AWS_ENDPOINT_URL: {endpoint!r} is not an http(s)://host[:port] URL")
    if u.scheme == "http" and os.environ.get("EDT_S3_ALLOW_HTTP") != "1":
        host = u.hostname
        try:
            loop = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loop = host == "localhost"
        if not loop:
            raise ConfigError(f"AWS_ENDPOINT_URL: {endpoint} is plain http to a host that is not loopback: use "
                              f"https, or set EDT_S3_ALLOW_HTTP=1 if the network between the machines is trusted")


def mirror_of(url: str) -> Path:
    """The local mirror folder of s3://bucket/prefix (no network call)."""
    bucket, prefix = split_url(url)
    u = urlparse(_endpoint() or "https://s3.amazonaws.com")
    host = f"{u.hostname}_{u.port}" if u.port else (u.hostname or "s3")
    return cache_root() / host / bucket / prefix if prefix else cache_root() / host / bucket


def attach(url: str, *, check: bool = True) -> Path:
    """The mirror folder of `url`, its store registered for sharedfs (once per process). `check`: the bucket is
    reached now (HEAD bucket, a conditional PUT probe), so a typo, refused credentials or a server that does not
    answer is one line before anything is written."""
    bucket, prefix = split_url(url)
    root = mirror_of(url)
    with _lock:
        store = _stores.get(os.fspath(root))
        if store is None:
            store = ObjectStore(url, bucket, prefix, root)
            root.mkdir(parents=True, exist_ok=True)  # a fresh machine's mirror: the folders above it exist
            _stores[os.fspath(root)] = store
    if check:
        store.check()
    return root


def store_for(path: str | os.PathLike) -> "ObjectStore | None":
    """The store whose mirror holds `path`, or None: a plain disk, or a **local** path of the mirror (a name
    starting with "." in it: temp files and temp folders are written in the mirror and published by a rename,
    never uploaded under their own names). Cheap when no store is attached."""
    if not _stores:
        return None
    p = os.fspath(path)
    for root, store in _stores.items():
        if p == root:
            return store
        if p.startswith(root + os.sep):
            if any(part.startswith(".") for part in p[len(root) + 1:].split(os.sep)):
                return None
            return store
    return None


def mirror_store(path: str | os.PathLike) -> "ObjectStore | None":
    """The store whose mirror holds `path`, local names included (see store_for)."""
    p = os.fspath(path)
    for root, store in list(_stores.items()):
        if p == root or p.startswith(root + os.sep):
            return store
    return None


def url_of(path: str | os.PathLike) -> str:
    """s3://bucket/key for a mirror path (for messages); the path itself elsewhere."""
    store = store_for(path)
    return store.url_of(path) if store else os.fspath(path)


def _no_expect_continue(request, **_) -> None:
    """No `Expect: 100-continue` (botocore adds it to every PUT): SeaweedFS 4.48 answers an empty PUT that carries
    it with an interim response the client does not consume, which the next request on that connection reads as its
    answer (and then waits out the read timeout: 20 s a call, found by the first run on its gateway). The header only
    saves sending a body the server would refuse; our bodies are at most PART_BYTES."""
    if "Expect" in request.headers:
        del request.headers["Expect"]


def where(path: str | os.PathLike) -> str:
    """A path for a user's message: an object's s3:// URL with its local copy, or the path itself."""
    store = store_for(path)
    return f"{store.url_of(path)} (local copy: {path})" if store else os.fspath(path)


def _client_error_code(e: BaseException) -> tuple[str, int]:
    resp = getattr(e, "response", None) or {}
    code = str((resp.get("Error") or {}).get("Code") or "")
    status = int((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    return code, status


class ObjectStore:
    """One bucket prefix and its local mirror (see the module doc)."""

    def __init__(self, url: str, bucket: str, prefix: str, mirror: Path):
        self.url, self.bucket, self.prefix, self.mirror = url.rstrip("/"), bucket, prefix, mirror
        self._client = None
        self._client_lock = threading.Lock()
        self._checked = False
        self._folders: set[str] = set()  # folder markers this process has put
        # the mirror copies this process downloaded, least recently opened first (path -> bytes): past
        # cache_bytes() the oldest are removed (a reader that has one open keeps reading it: POSIX)
        self._downloads: OrderedDict[str, int] = OrderedDict()
        self._downloads_lock = threading.Lock()

    # -- the client ------------------------------------------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self):
        from train.core.errors import ConfigError

        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError(f"base_dir {self.url}: an s3:// BASE_DIR needs boto3: pip install 'edt[s3]' "
                              f"(or pip install boto3)") from None
        _check_endpoint(_endpoint())
        cfg = Config(connect_timeout=5, read_timeout=20, retries={"max_attempts": 2, "mode": "standard"},
                     max_pool_connections=4 * PARALLEL, tcp_keepalive=True,
                     request_checksum_calculation="when_required", response_checksum_validation="when_required")
        for name in ("botocore", "boto3", "urllib3"):  # their INFO lines ("Found credentials in ...") are noise
            logging.getLogger(name).setLevel(logging.WARNING)
        session = boto3.session.Session()
        region = session.region_name or "us-east-1"  # R2 / MinIO / SeaweedFS accept any; AWS redirects
        client = session.client("s3", region_name=region, config=cfg)
        client.meta.events.register("before-send.s3", _no_expect_continue)
        return client

    # -- names -----------------------------------------------------------------------------------------------------
    def key(self, path: str | os.PathLike) -> str:
        rel = os.path.relpath(os.fspath(path), self.mirror)
        rel = "" if rel == "." else rel.replace(os.sep, "/")
        return f"{self.prefix}/{rel}".strip("/") if self.prefix else rel

    def url_of(self, path: str | os.PathLike) -> str:
        return f"{SCHEME}{self.bucket}/{self.key(path)}"

    # -- errors ------------------------------------------------------------------------------------------------------
    def _os_error(self, e: BaseException, path: str | os.PathLike, op: str) -> BaseException:
        """The OSError (or ConfigError) for a client exception on `path`."""
        from train.core.errors import ConfigError

        where = self.url_of(path)
        name = type(e).__name__
        code, status = _client_error_code(e)
        if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket"):
            return FileNotFoundError(errno.ENOENT, "no such object", where)
        if code in ("PreconditionFailed", "412") or status == 412:
            return FileExistsError(errno.EEXIST, "object exists", where)
        if code == "NoSuchBucket":
            return ConfigError(f"base_dir {self.url}: bucket {self.bucket!r} does not exist at "
                               f"{_endpoint() or 'AWS S3'}: create it (aws s3 mb s3://{self.bucket}) or fix the name")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden",
                    "ExpiredToken", "InvalidToken") or status == 403:
            return ConfigError(f"base_dir {self.url}: the S3 server refused the credentials ({code or status} on "
                               f"{op} {where}): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                               f"and that they may read and write the bucket")
        if name == "NoCredentialsError":
            return ConfigError(f"base_dir {self.url}: no S3 credentials found: set AWS_ACCESS_KEY_ID and "
                               f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE with ~/.aws/credentials)")
        from train.core.errors import UserError

        client_side = type(e).__module__.split(".")[0] in ("botocore", "urllib3", "s3transfer") or \
            isinstance(getattr(e, "response", None), dict)  # a server's answer (ClientError and its kin)
        if isinstance(e, UserError) or not client_side:
            return e  # said already, the local side (the mirror's disk), or a bug: as it is
        # a connection refused or reset, a timeout (botocore's ReadTimeoutError is an OSError without an errno), a
        # 5xx, a throttle: the storage's passing state (retried)
        return OSError(errno.EIO, f"S3 {op} failed: {code or name} {str(e).splitlines()[0][:160]}", where)

    def call(self, op: str, path: str | os.PathLike, fn):
        try:
            return fn()
        except Exception as e:  # botocore's exceptions, mapped (see _os_error)
            raise self._os_error(e, path, op) from None

    # -- the checks at attach ----------------------------------------------------------------------------------------
    def check(self) -> None:
        """The bucket answers, the credentials work, conditional PUTs are enforced (one line each, else)."""
        import time

        from train.core.errors import ConfigError

        if self._checked:
            return
        probe = self.mirror / f".edt-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        key = self.key(probe)
        try:
            deadline, delay = time.monotonic() + REACH_S, 0.25
            while True:  # a server starting up answers within REACH_S; one that does not is a wrong endpoint
                try:
                    self.call("head bucket", self.mirror, lambda: self.client.head_bucket(Bucket=self.bucket))
                    break
                except OSError as e:
                    if type(e) is not OSError or time.monotonic() + delay > deadline:
                        raise
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)
        except FileNotFoundError:  # HEAD has no body: a missing bucket is a bare 404
            raise ConfigError(f"base_dir {self.url}: bucket {self.bucket!r} does not exist at "
                              f"{_endpoint() or 'AWS S3'}: create it (aws s3 mb s3://{self.bucket}) or fix the "
                              f"name") from None
        except OSError:  # connection refused, timeouts, 5xx, for REACH_S
            raise ConfigError(f"base_dir {self.url}: the S3 endpoint {_endpoint() or 'AWS S3'} does not answer: "
                              f"check AWS_ENDPOINT_URL and that the server is up") from None
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=b"1", IfNoneMatch="*")
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=b"2", IfNoneMatch="*")
                enforced = False
            except Exception as e:
                if not isinstance(self._os_error(e, probe, "put"), FileExistsError):
                    raise
                enforced = True
        except Exception as e:
            err = self._os_error(e, probe, "put")
            raise (err if isinstance(err, ConfigError) else
                   ConfigError(f"base_dir {self.url}: cannot write to the bucket ({err})")) from None
        finally:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=key)
            except Exception:  # noqa: BLE001 - a leftover probe object is harmless (a dot name, never listed)
                pass
        if not enforced:
            raise ConfigError(f"base_dir {self.url}: this S3 server ignores conditional writes (If-None-Match), "
                              f"which the protocol's markers and claims need: use AWS S3, R2, MinIO or SeaweedFS "
                              f"recent enough to support them")
        self._checked = True

    # -- listings ----------------------------------------------------------------------------------------------------
    def listdir(self, folder: str | os.PathLike) -> list[str]:
        """Names of the objects and sub-folders directly in `folder` (FileNotFoundError: none at all); drops mirror
        copies of objects gone from it."""
        key = self.key(folder)
        pfx = f"{key}/" if key else ""
        names: set[str] = set()
        seen_any = False
        token = None
        while True:
            kw = dict(Bucket=self.bucket, Prefix=pfx, Delimiter="/", MaxKeys=1000)
            if token:
                kw["ContinuationToken"] = token
            page = self.call("list", folder, lambda: self.client.list_objects_v2(**kw))
            for obj in page.get("Contents") or []:
                seen_any = True
                name = obj["Key"][len(pfx):]
                if name:
                    names.add(name)
            for cp in page.get("CommonPrefixes") or []:
                seen_any = True
                name = cp["Prefix"][len(pfx):].rstrip("/")
                if name:
                    names.add(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        if not seen_any and key:
            raise FileNotFoundError(errno.ENOENT, "no such folder", self.url_of(folder))
        out = sorted(n for n in names if not n.startswith(".edt-probe-"))
        self._drop_gone(Path(folder), set(out))
        return out

    def _drop_gone(self, folder: Path, present: set[str]) -> None:
        """Remove mirror copies (files with a sidecar) in `folder` whose objects the listing no longer shows. Folders
        stay (another process on this machine may be about to write a temp file in one it just made)."""
        try:
            local = os.listdir(folder)
        except OSError:
            return
        for name in local:
            if name.startswith(".") or name in present:
                continue
            p = folder / name
            if p.is_dir() and not p.is_symlink():
                for sub, _dirs, files in os.walk(p):
                    for f in files:
                        if not f.startswith(".") and (Path(sub) / (ETAG_PREFIX + f)).exists():
                            _unlink_quiet(Path(sub) / f)
                            _unlink_quiet(Path(sub) / (ETAG_PREFIX + f))
            elif (folder / (ETAG_PREFIX + name)).exists():
                _unlink_quiet(p)
                _unlink_quiet(folder / (ETAG_PREFIX + name))

    def stat(self, path: str | os.PathLike) -> os.stat_result:
        import stat as stat_

        key = self.key(path)
        try:
            head = self.call("stat", path, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        except FileNotFoundError:
            page = self.call("list", path, lambda: self.client.list_objects_v2(
                Bucket=self.bucket, Prefix=f"{key}/", MaxKeys=1))
            if not page.get("Contents") and not page.get("CommonPrefixes"):
                raise
            return os.stat_result((stat_.S_IFDIR | 0o755, 0, 0, 2, 0, 0, 0, 0, 0, 0))
        # st_ino and st_mtime_ns tell versions apart (a cache keyed on them sees every replace); st_mtime is the
        # server's LastModified (whole seconds): a lease's age on the server's clock (edt/protocol.py)
        mod = head["LastModified"].timestamp()
        tag = int(hashlib.md5(head.get("ETag", "").encode()).hexdigest()[:12], 16)
        size, t = int(head["ContentLength"]), int(mod)
        return os.stat_result((stat_.S_IFREG | 0o644, tag, 0, 1, 0, 0, size, t, t, t, mod, mod, mod,
                               t * 10**9 + tag % 10**9, t * 10**9 + tag % 10**9, t * 10**9 + tag % 10**9))

    def walk(self, folder: str | os.PathLike, markers: bool = False) -> list[str]:
        """Every object under `folder`, as paths relative to it ('/'-separated; folder markers only with
        `markers`)."""
        key = self.key(folder)
        pfx = f"{key}/" if key else ""
        out: list[str] = []
        token = None
        while True:
            kw = dict(Bucket=self.bucket, Prefix=pfx, MaxKeys=1000)
            if token:
                kw["ContinuationToken"] = token
            page = self.call("list", folder, lambda: self.client.list_objects_v2(**kw))
            out += [o["Key"][len(pfx):] for o in page.get("Contents") or [] if markers or not o["Key"].endswith("/")]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    def delete_tree(self, folder: str | os.PathLike) -> None:
        """Every object under `folder` deleted, markers (COMMITTED, MANIFEST.json) first: a reader that still finds
        the folder never trusts what is left of it. Then its mirror copy."""
        import shutil

        names = self.walk(folder, markers=True)  # the folder markers of its sub-folders too (else they stay listed)
        files = sorted((n for n in names if not n.endswith("/")),
                       key=lambda n: (n.rsplit("/", 1)[-1] not in ("COMMITTED", MANIFEST), n))
        # then every sub-folder's key, deepest first, marker or not, and the folder's own: a store with real
        # folders (SeaweedFS's gateway) lists an emptied folder until a cleaner of its own removes it (30 s there,
        # behind by minutes in a long run: every machine's mirror kept the pruned rounds); a key that is not there
        # deletes as nothing on S3
        subs = {n.rstrip("/") for n in names if n.endswith("/")}
        subs |= {"/".join(n.split("/")[:i]) for n in files for i in range(1, n.count("/") + 1)}
        key = self.key(folder)
        for n in [*files, *(f"{d}/" for d in sorted(subs, key=lambda d: -d.count("/"))), ""]:
            k = f"{key}/{n}"
            self.call("unlink", folder, lambda: self.client.delete_object(Bucket=self.bucket, Key=k))
        self._folders = {f for f in self._folders if f != key and not f.startswith(key + "/")}
        shutil.rmtree(folder, ignore_errors=True)

    def move(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        """An object renamed: a server-side copy (dst appears whole; above PART_BYTES a multipart copy in parallel
        parts: a single CopyObject can outlast a read timeout, and AWS refuses one above 5 GiB), then src
        deleted."""
        skey, dkey = self.key(src), self.key(dst)
        size = int(self.call("rename", src, lambda: self.client.head_object(
            Bucket=self.bucket, Key=skey))["ContentLength"])
        source = {"Bucket": self.bucket, "Key": skey}
        if size <= PART_BYTES:
            self.call("rename", src, lambda: self.client.copy_object(Bucket=self.bucket, Key=dkey,
                                                                     CopySource=source))
        else:
            up = self.call("rename", dst, lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=dkey))
            uid, n = up["UploadId"], (size + PART_BYTES - 1) // PART_BYTES
            try:
                def part(i: int) -> dict:
                    a, b = i * PART_BYTES, min(size, (i + 1) * PART_BYTES) - 1
                    r = self.call("rename", dst, lambda: self.client.upload_part_copy(
                        Bucket=self.bucket, Key=dkey, UploadId=uid, PartNumber=i + 1, CopySource=source,
                        CopySourceRange=f"bytes={a}-{b}"))
                    return {"PartNumber": i + 1, "ETag": r["CopyPartResult"]["ETag"]}
                with ThreadPoolExecutor(min(PARALLEL, n), thread_name_prefix="s3-copy") as pool:
                    parts = list(pool.map(part, range(n)))
                self.call("rename", dst, lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=dkey, UploadId=uid, MultipartUpload={"Parts": parts}))
            except BaseException:
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=dkey, UploadId=uid)
                except Exception:  # noqa: BLE001 - invisible either way
                    pass
                raise
        self.call("unlink", src, lambda: self.client.delete_object(Bucket=self.bucket, Key=skey))
        _unlink_quiet(self._sidecar(Path(dst)))
        try:
            os.replace(src, dst)  # a mirror copy follows its object
            os.replace(self._sidecar(Path(src)), self._sidecar(Path(dst)))
        except OSError:
            pass

    def server_time(self) -> float:
        """The server's clock (the Date of an answer), for leases judged on the storage's clock."""
        from email.utils import parsedate_to_datetime

        resp = self.call("reach bucket", self.mirror, lambda: self.client.head_bucket(Bucket=self.bucket))
        date = (resp.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")
        return parsedate_to_datetime(date).timestamp() if date else __import__("time").time()

    # -- whole objects -------------------------------------------------------------------------------------------------
    def read_bytes(self, path: str | os.PathLike) -> bytes:
        key = self.key(path)

        def get() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return self.call("read", path, get)

    def put_bytes(self, path: str | os.PathLike, data, *, if_absent: bool = False) -> str:
        """One PUT of `data` (bytes-like) at `path`'s key; `if_absent`: only if no object has it (FileExistsError
        otherwise). Returns the new ETag."""
        key = self.key(path)
        body = bytes(memoryview(data).cast("B"))
        kw = {"IfNoneMatch": "*"} if if_absent else {}
        out = self.call("write", path, lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **kw))
        _unlink_quiet(self._sidecar(Path(path)))  # a mirror copy of an older version is stale now
        return out.get("ETag", "")

    def delete(self, path: str | os.PathLike) -> None:
        key = self.key(path)
        self.call("unlink", path, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))
        _unlink_quiet(self._sidecar(Path(path)))
        _unlink_quiet(Path(path))

    def make_folder(self, folder: str | os.PathLike) -> None:
        """A folder marker (`key/`, empty): the folder is listed in its parent before anything is in it."""
        key = self.key(folder)
        os.makedirs(folder, exist_ok=True)
        if not key or key in self._folders:
            return
        self.call("mkdir", folder, lambda: self.client.put_object(Bucket=self.bucket, Key=key + "/", Body=b""))
        self._folders.add(key)

    # -- files: upload a local file, download to the mirror --------------------------------------------------------
    def upload(self, local: str | os.PathLike, path: str | os.PathLike) -> str:
        """Publish the local file `local` as the object of `path`: whole or not at all (one PUT, or a multipart upload
        that completes at once; a crash part-way leaves nothing listed). Returns the ETag."""
        key = self.key(path)
        size = os.path.getsize(local)
        if size <= PART_BYTES:
            with open(local, "rb") as f:
                body = f.read()
            out = self.call("write", path, lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body))
            return out.get("ETag", "")
        return self._multipart(local, key, size, path)

    def _multipart(self, local, key: str, size: int, path) -> str:
        up = self.call("write", path, lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=key))
        uid = up["UploadId"]
        n = (size + PART_BYTES - 1) // PART_BYTES
        try:
            fd = os.open(local, os.O_RDONLY)
            try:
                def part(i: int) -> dict:
                    body = os.pread(fd, PART_BYTES, i * PART_BYTES)
                    r = self.call("write", path, lambda: self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=uid, PartNumber=i + 1, Body=body))
                    return {"PartNumber": i + 1, "ETag": r["ETag"]}
                with ThreadPoolExecutor(min(PARALLEL, n), thread_name_prefix="s3-up") as pool:
                    parts = list(pool.map(part, range(n)))
            finally:
                os.close(fd)
            out = self.call("write", path, lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts}))
            return out.get("ETag", "")
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            except Exception:  # noqa: BLE001 - the upload stays invisible either way; a lifecycle rule reaps it
                pass
            raise

    def _sidecar(self, local: Path) -> Path:
        return local.with_name(ETAG_PREFIX + local.name)

    def note_local(self, local: Path, etag: str) -> None:
        """Record that the mirror file `local` holds the object version `etag` (sidecar: ETag and inode)."""
        try:
            ino = os.stat(local).st_ino
            tmp = local.with_name(f".{local.name}.etag-{os.getpid()}-{uuid.uuid4().hex[:6]}")
            tmp.write_text(json.dumps({"etag": etag, "ino": ino}))
            os.replace(tmp, self._sidecar(local))
        except OSError:
            pass

    def _local_copy(self, local: Path, etag: str) -> int | None:
        """A read descriptor of the mirror file if it holds version `etag` (its inode checked after the open)."""
        try:
            meta = json.loads(self._sidecar(local).read_text())
            fd = os.open(local, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (OSError, ValueError):
            return None
        if meta.get("etag") == etag and os.fstat(fd).st_ino == meta.get("ino"):
            return fd
        os.close(fd)
        return None

    def open_read(self, path: str | os.PathLike) -> int:
        """A read-only descriptor of a local copy of the object at `path` (downloaded unless the mirror holds this
        version)."""
        local = Path(path)
        key = self.key(local)
        head = self.call("open", path, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        etag, size = head.get("ETag", ""), int(head["ContentLength"])
        fd = self._local_copy(local, etag)
        if fd is not None:
            self._note_download(local, size)
            return fd
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.dl-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            # IfMatch: every byte of one version (a replace while it is read is a 412: FileExistsError, retried)
            if size <= PART_BYTES:
                body = self.call("read", path, lambda: self.client.get_object(
                    Bucket=self.bucket, Key=key, IfMatch=etag)["Body"].read())
                with open(tmp, "wb") as f:
                    f.write(body)
            else:  # boto3's s3transfer: parallel ranged GETs streamed to the file (twice our own ranged reads'
                # speed in bench/s3_clients.py), each range pinned to the version
                from boto3.s3.transfer import TransferConfig

                cfg = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES // 2,
                                     max_concurrency=PARALLEL, use_threads=True)
                self.call("read", path, lambda: self.client.download_file(self.bucket, key, os.fspath(tmp),
                                                                         Config=cfg))
                # s3transfer takes no If-Match: the version is checked after (objects here are replaced whole
                # under a new name, never rewritten; a replace while it was read is read again)
                again = self.call("open", path, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
                if again.get("ETag", "") != etag:
                    raise FileExistsError(errno.EEXIST, "object replaced while read", self.url_of(path))
            if os.path.getsize(tmp) != size:
                raise OSError(errno.EIO, f"S3 read returned {os.path.getsize(tmp)} of {size} bytes",
                              self.url_of(path))
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            os.replace(tmp, local)
        except FileExistsError:  # If-Match failed (412): the object was replaced while read
            _unlink_quiet(tmp)
            raise OSError(errno.EIO, "object replaced while read", self.url_of(path)) from None
        except BaseException:
            _unlink_quiet(tmp)
            raise
        self.note_local(local, etag)
        self._note_download(local, size)
        return fd

    def _note_download(self, local: Path, size: int) -> None:
        """Keep the mirror's downloaded copies within cache_bytes() (the one just opened always stays): a worker
        reads a new θ every round, and the rounds it no longer needs are pruned from the bucket, not from here."""
        key, budget, drop = os.fspath(local), cache_bytes(), []
        with self._downloads_lock:
            self._downloads.pop(key, None)
            self._downloads[key] = size
            total = sum(self._downloads.values())
            while total > budget and len(self._downloads) > 1:
                old, n = self._downloads.popitem(last=False)
                total -= n
                drop.append(old)
        for old in drop:
            _unlink_quiet(Path(old))
            _unlink_quiet(self._sidecar(Path(old)))

    def publish(self, src: str | os.PathLike, dst: str | os.PathLike, *, once: bool = False) -> bool:
        """`sharedfs.replace(src, dst)` on the store: upload the local temp `src` (a file, or a folder with
        its MANIFEST.json last) as `dst`, then move it into the mirror as the copy of what was uploaded. `once`
        (a folder): its MANIFEST.json is created only if absent: False when another attempt published the folder
        first."""
        src, dst = Path(src), Path(dst)
        if src.is_dir():
            import shutil

            files = sorted((p for p in src.rglob("*") if p.is_file() and not p.name.startswith(".")),
                           key=lambda p: (p.name == MANIFEST and p.parent == src, str(p)))
            if once and self._exists_key(self.key(dst / MANIFEST)):
                return False
            for p in files:
                if p.name == MANIFEST and p.parent == src:
                    if once:
                        try:
                            self.put_bytes(dst / MANIFEST, p.read_bytes(), if_absent=True)
                        except FileExistsError:
                            return False
                        continue
                self.upload(p, dst / p.relative_to(src))
            self._folders.add(self.key(dst))
            if dst.exists():
                shutil.rmtree(dst, ignore_errors=True)
            os.replace(src, dst)
            return True
        etag = self.upload(src, dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        self.note_local(dst, etag)
        return True

    def _exists_key(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as e:  # noqa: BLE001 - mapped: a missing key is False, anything else goes up
            err = self._os_error(e, self.mirror, "stat")
            if isinstance(err, FileNotFoundError):
                return False
            raise err from None

    def local_copy(self, path: str | os.PathLike) -> Path:
        """The mirror path of `path`, holding the object's current version (a file) or every object under it (a
        folder): for libraries that open files by name (transformers, safetensors' mmap)."""
        p = Path(path)
        try:
            names = None
            os.close(self.open_read(p))
        except FileNotFoundError:
            names = self.walk(p)
            if not names:
                raise
        for n in names or []:
            os.close(self.open_read(p / n))
        return p


def _unlink_quiet(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass
