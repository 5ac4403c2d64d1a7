"""Publish and load throughput against the usual ways of saving a state dict.

Every variant is measured in the same invocation, interleaved round by round
(the order rotates each round) so that noise from other processes on the
machine hits them all alike. Each round ends in fsync for every save variant,
so no variant leaves dirty pages for the next one to pay for. Loads read
files that were just written, i.e. from the page cache, for every variant
alike (dropping the cache would need root and would disturb the machine).

Reported: median seconds over ``--runs`` rounds after one warm-up round, the
median over rounds of each variant's time divided by ``save_file + fsync``
(or ``load_file``) of the same round, and the median CPU seconds the whole
process used for the variant (all threads; an async publish counted to its
commit), which shows the work done independently of how busy the machine is. ``--mib`` sets the size of the
transformer-shaped state dict (env ``REGISTRY_BENCH_MIB``), ``--small`` the
number of small tensors of the second workload.

    ./scripts/bench io [--mib 1024] [--small 2000] [--runs 5] [--dir DIR]
    ./scripts/bench io --only lazy [--mib 256] [--runs 15] [--url URL]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import safetensors.torch as st
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import settle, small_state, transformer_state  # noqa: E402
from registry import Registry  # noqa: E402
from registry.fs.filemaps import read_directory  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
CHUNK = 16 << 20


# --------------------------------------------------------------------------- workloads


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# --------------------------------------------------------------------------- helpers


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(path)


def sha256_1mib(path: Path) -> str:
    """The reference module's hashing: 1 MiB reads, one thread."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def reference_save(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """The reference module's algorithm: write every file, re-read each to hash it, fsync."""
    directory.mkdir()
    meta = {"epoch": 0, "consumed_samples": 0, "timestamp": "t", "optimizer_step": 1, "policy_version": None}
    (directory / "meta.json").write_text(json.dumps(meta, indent=2))
    (directory / "config.json").write_text(json.dumps({}, indent=2))
    st.save_file(state, str(directory / "model.safetensors"))
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_1mib(p)} for p in sorted(directory.iterdir())}
    for name in files:
        fsync_path(directory / name)
    manifest = {"format_version": 1, "created_at": "t", "optimizer_step": 1, "policy_version": None,
                "tensors": sorted(state), "files": files}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    fsync_path(directory / "manifest.json")
    fsync_path(directory)


def reference_load(directory: Path) -> dict[str, torch.Tensor]:
    manifest = json.loads((directory / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        path = directory / name
        if path.stat().st_size != entry["size"] or sha256_1mib(path) != entry["sha256"]:
            raise RuntimeError(f"checksum mismatch {path}")
    return st.load_file(str(directory / "model.safetensors"))


def floor_write(path: Path, size: int, buf: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            left -= os.write(fd, buf[:min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)


def floor_map_hash(path: Path, digest: str, pool: ThreadPoolExecutor) -> None:
    """Map the file and hash its pieces on all cores (order-free): the least a verified load can do."""
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    view = memoryview(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,)).numpy()).cast("B")
    fn = xxhash.xxh3_128_hexdigest if digest == "xxh3_128" else (lambda b: hashlib.sha256(b).hexdigest())
    for fut in [pool.submit(fn, view[i:i + CHUNK]) for i in range(0, size, CHUNK)]:
        fut.result()


def touch_all(tensors: dict[str, torch.Tensor]) -> None:
    """Read every page of lazily mapped tensors (what using them does)."""
    for t in tensors.values():
        if t.numel():
            xxhash.xxh3_64_intdigest(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def floor_read(path: Path, digest: str | None, pool: ThreadPoolExecutor) -> None:
    """Read the file into one buffer; with ``digest``, hash its pieces on all cores (order-free)."""
    size = path.stat().st_size
    out = torch.empty(size, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")
    futures = []
    fn = (lambda b: xxhash.xxh3_128_hexdigest(b)) if digest == "xxh3_128" else (
        lambda b: hashlib.sha256(b).hexdigest())
    with open(path, "rb", buffering=0) as f:
        for start in range(0, size, CHUNK):
            piece = view[start:start + CHUNK]
            f.readinto(piece)
            if digest is not None:
                futures.append(pool.submit(fn, piece))
    for fut in futures:
        fut.result()


# --------------------------------------------------------------------------- measuring


class Table:
    def __init__(self, baseline: str) -> None:
        self.baseline = baseline
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float, cpu: float) -> None:
        self.times.setdefault(name, []).append(seconds)
        self.cpu.setdefault(name, []).append(cpu)

    def rows(self) -> list[tuple[str, float, float, float]]:
        base = self.times[self.baseline]
        out = []
        for name, ts in self.times.items():
            ratios = [t / b for t, b in zip(ts, base)]
            out.append((name, statistics.median(ts), statistics.median(ratios), statistics.median(self.cpu[name])))
        return out


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_workload(label: str, state: dict[str, torch.Tensor], work: Path, runs: int) -> list[str]:
    total = nbytes(state)
    reg = Registry.open(url=f"sqlite:///{work / 'catalog.db'}", root=work / "root")
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 16)
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    step = iter(range(1, 1_000_000))
    out_dir = work / "out"
    async_done: list[float] = []

    def clean() -> None:
        # every variant's output is deleted before the next one runs, ours too, so that none of them
        # pays for the page cache (or disk blocks) that another one left behind
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir()
        while published:
            shutil.rmtree(published.pop(), ignore_errors=True)

    published: list[Path] = []

    def publish_blocking() -> float:
        return timed(lambda: published.append(reg.publish(label, next(step), state).path))

    first = next(iter(state.values()))

    def publish_dedup_miss() -> float:
        first.view(-1)[0] += 1  # bytes no earlier step holds: the candidate query runs and finds nothing to link
        return timed(lambda: published.append(reg.publish(label + "-dedup", next(step), state, dedup=True).path))

    def sha256_one_core() -> float:
        def run() -> None:
            digest = hashlib.sha256()
            for t in state.values():
                data = t.contiguous().view(-1).view(torch.uint8).numpy().data
                for start in range(0, len(data), CHUNK):
                    digest.update(data[start:start + CHUNK])
        return timed(run)

    def publish_unverified() -> float:
        return timed(lambda: published.append(reg.publish(label, next(step), state, verify=False).path))

    def publish_async() -> float:
        t0 = time.perf_counter()
        future = reg.publish(label, next(step), state, blocking=False)
        returned = time.perf_counter() - t0
        published.append(future.result().path)
        async_done.append(time.perf_counter() - t0)
        return returned

    def save_file() -> float:
        def run() -> None:
            st.save_file(state, str(out_dir / "m.safetensors"))
            fsync_path(out_dir / "m.safetensors")
            fsync_path(out_dir)
        return timed(run)

    def torch_save() -> float:
        def run() -> None:
            torch.save(state, out_dir / "m.pt")
            fsync_path(out_dir / "m.pt")
            fsync_path(out_dir)
        return timed(run)

    def dcp_save() -> float:
        import torch.distributed.checkpoint as dcp
        return timed(lambda: dcp.save(state, checkpoint_id=out_dir / "dcp"))  # fsyncs (sync_files=True)

    def reference() -> float:
        return timed(lambda: reference_save(out_dir / "ref", state))

    def floor() -> float:
        return timed(lambda: (floor_write(out_dir / "floor", total, buf), fsync_path(out_dir)))

    saves: dict[str, Callable[[], float]] = {
        "registry publish (blocking, sha256+xxh3-pieces manifest, fsync, commit)": publish_blocking,
        "registry publish (verify=False: no publish-time check)": publish_unverified,
        "registry publish (async: until the trainer continues)": publish_async,
        "safetensors save_file + fsync": save_file,
        "torch.save + fsync": torch_save,
        "torch.distributed.checkpoint.save": dcp_save,
        "reference algorithm (write, re-read to hash, fsync)": reference,
        "floor: write the same bytes + fsync": floor,
        "registry publish (blocking, dedup on, a miss)": publish_dedup_miss,
        "sha256 of the same bytes, one core": sha256_one_core,
    }
    save_table = Table("safetensors save_file + fsync")
    names = list(saves)
    for round_ in range(runs + 1):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            clean()
            settle()
            cpu0 = time.process_time()
            seconds = saves[name]()
            if round_:
                save_table.add(name, seconds, time.process_time() - cpu0)
        if round_ == 0:
            async_done.clear()

    # loads, from files written once and then read by every variant in every round
    clean()
    info = reg.publish(label, next(step), state)
    st.save_file(state, str(out_dir / "m.safetensors"))
    torch.save(state, out_dir / "m.pt")
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=out_dir / "dcp")
    reference_save(out_dir / "ref", state)
    weights = info.path / "model.safetensors"
    template = {k: torch.empty_like(v) for k, v in state.items()}
    loads: dict[str, Callable[[], object]] = {
        "registry load(verify=False)": lambda: reg.load(f"{label}@{info.step}", verify=False),
        "registry load(verify=True) (xxh3 pieces checked)": lambda: reg.load(f"{label}@{info.step}", verify=True),
        "store only: read_directory(verify=False) (no catalog)": lambda: read_directory(info.path, verify=False),
        "store only: read_directory(verify=True) (xxh3 pieces)": lambda: read_directory(info.path, verify=True),
        "store only: read_directory, sha256 checked": lambda: _sha256_read(info.path),
        "safetensors load_file (same file)": lambda: st.load_file(str(weights)),
        "safetensors load_file + read every page": lambda: touch_all(st.load_file(str(weights))),
        "registry load(verify=False) + read every page":
            lambda: touch_all(reg.load(f"{label}@{info.step}", verify=False).state_dict),
        "torch.load (weights_only)": lambda: torch.load(out_dir / "m.pt", weights_only=True),
        "torch.distributed.checkpoint.load": lambda: dcp.load(template, checkpoint_id=out_dir / "dcp"),
        "reference algorithm (sha256 all files, then load)": lambda: reference_load(out_dir / "ref"),
        "floor: read the bytes into memory": lambda: floor_read(weights, None, pool),
        "floor: map + xxh3 pieces on all cores": lambda: floor_map_hash(weights, "xxh3_128", pool),
        "floor: map + sha256 pieces on all cores": lambda: floor_map_hash(weights, "sha256", pool),
    }
    load_table = Table("safetensors load_file (same file)")
    lnames = list(loads)
    for round_ in range(runs + 1):
        order = lnames[round_ % len(lnames):] + lnames[:round_ % len(lnames)]
        for name in order:
            settle()
            cpu0 = time.process_time()
            seconds = timed(loads[name])
            if round_:
                load_table.add(name, seconds, time.process_time() - cpu0)
    reg.close()
    pool.shutdown()
    shutil.rmtree(work / "root", ignore_errors=True)
    clean()

    lines = [f"\n### {label}: {len(state)} tensors, {total / 2**20:.0f} MiB\n",
             "| save | median s | x save_file+fsync | CPU s |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {t:.3f} | {r:.2f} | {c:.2f} |" for n, t, r, c in save_table.rows()]
    if async_done:
        lines.append(f"| (async publish: call to committed) | {statistics.median(async_done):.3f} | |")
    lines += ["", "| load | median s | x load_file | CPU s |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {t:.3f} | {r:.2f} | {c:.2f} |" for n, t, r, c in load_table.rows()]
    derived = _derived(save_table, load_table)
    return lines + [""] + derived


def _sha256_read(path: Path) -> object:
    """Our reader forced to sha256: what a load would cost without the xxh3 digests."""
    import dataclasses

    import registry.fs.filemaps as filemaps  # the reader calls check_file_digest by this name
    real = filemaps.check_file_digest
    filemaps.check_file_digest = lambda directory, entry, data: real(  # type: ignore[assignment]
        directory, dataclasses.replace(entry, xxh3_128=None, piece_size=None, xxh3_128_pieces=None), data)
    try:
        return read_directory(path, verify=True)
    finally:
        filemaps.check_file_digest = real  # type: ignore[assignment]


def _derived(saves: Table, loads: Table) -> list[str]:
    def med_ratio(table: Table, a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(table.times[a], table.times[b]))
    pub = "registry publish (blocking, sha256+xxh3-pieces manifest, fsync, commit)"
    floor = [max(a, b) for a, b in zip(saves.times["safetensors save_file + fsync"],
                                       saves.times["sha256 of the same bytes, one core"])]
    over_floor = statistics.median(p / f for p, f in zip(saves.times[pub], floor))
    lazy_ms = statistics.median(1e3 * (a - b) for a, b in zip(loads.times["registry load(verify=False)"],
                                                              loads.times["safetensors load_file (same file)"]))
    store_ratio = med_ratio(loads, "store only: read_directory(verify=False) (no catalog)",
                            "safetensors load_file (same file)")
    touch_ratio = med_ratio(loads, "registry load(verify=False) + read every page",
                            "safetensors load_file + read every page")
    verify_ratio = med_ratio(loads, "registry load(verify=True) (xxh3 pieces checked)",
                             "floor: map + xxh3 pieces on all cores")
    return [
        "| target | measured | goal |", "|---|---:|---:|",
        f"| publish / max(save_file+fsync, sha256 one core) | {over_floor:.2f} | <= 1.05 |",
        f"| publish dedup on (miss) / publish | "
        f"{med_ratio(saves, 'registry publish (blocking, dedup on, a miss)', pub):.3f} | <= 1.02 |",
        f"| load(verify=False) - load_file, ms | {lazy_ms:.2f} | <= 1 |",
        f"| publish / save_file+fsync | {med_ratio(saves, pub, 'safetensors save_file + fsync'):.2f} | <= 1.10 |",
        f"| publish / floor | {med_ratio(saves, pub, 'floor: write the same bytes + fsync'):.2f} | <= 1.25 |",
        f"| reference / publish | "
        f"{med_ratio(saves, 'reference algorithm (write, re-read to hash, fsync)', pub):.2f} | >= 1.7 |",
        f"| async return / blocking publish | "
        f"{med_ratio(saves, 'registry publish (async: until the trainer continues)', pub):.2f} | < 0.15 |",
        f"| load(verify=False) / load_file | "
        f"{med_ratio(loads, 'registry load(verify=False)', 'safetensors load_file (same file)'):.2f} | <= 1.10 |",
        f"| store read_directory(verify=False) / load_file | "
        f"{store_ratio:.2f} | <= 1.10 |",
        f"| load(verify=False)+touch / load_file+touch | "
        f"{touch_ratio:.2f} | <= 1.10 |",
        f"| load(verify=True) / floor map+xxh3 | "
        f"{verify_ratio:.2f} | <= 1.20 |",
    ]


# --------------------------------------------------------------------------- lazy load overhead


def bench_lazy(mib: int, work: Path, runs: int, url: str | None) -> list[str]:
    """A lazy ``load(verify=False)`` against ``load_file`` of the same file, and its parts.

    Neither reads the tensors' pages, so what separates them is the fixed
    cost of a load: the catalog's resolve with its reader lease (one
    transaction), the lease's release, the manifest read. Thread CPU is this thread's own: on a busy
    machine wall time also counts the time other processes held the core.
    """
    from registry.format.refs import parse_ref
    run = f"lazy-{os.getpid()}"  # a fresh run, also in a PostgreSQL catalog used before
    reg = Registry.open(url=url or f"sqlite:///{work / 'catalog.db'}", root=work / "root")
    state = transformer_state(mib)
    info = reg.publish(run, 1, state)
    del state
    weights = str(info.path / "model.safetensors")
    ref = parse_ref(f"{run}@1")
    catalog = reg.catalog

    def catalog_part() -> None:
        _, lease = catalog.resolve_leased(ref, holder=reg.writer, ttl=reg.lease_ttl)
        assert lease is not None
        catalog.release_lease(lease)

    def release() -> None:
        catalog.release_lease(catalog.acquire_lease(run, 1, holder=reg.writer, ttl=reg.lease_ttl))

    variants: dict[str, Callable[[], object]] = {
        "safetensors load_file (same file)": lambda: st.load_file(weights),
        "registry load(verify=False)": lambda: reg.load(ref, verify=False),
        "store only: read_directory(verify=False)": lambda: read_directory(info.path, verify=False),
        "catalog resolve (a read, for scale)": lambda: catalog.resolve(ref),
        "catalog part: resolve with its lease, release (what a load does)": catalog_part,
        "catalog lease + release": release,
    }
    walls: Table = Table("safetensors load_file (same file)")
    names = list(variants)
    for round_ in range(runs + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            settle()
            cpu0 = time.thread_time()
            seconds = timed(variants[name])
            if round_:
                walls.add(name, seconds, time.thread_time() - cpu0)
    gaps = [a - b for a, b in zip(walls.times["registry load(verify=False)"],
                                  walls.times["safetensors load_file (same file)"])]
    reg.close()
    lines = [f"\n### lazy load overhead: {catalog.dialect} catalog, {info.total_bytes / 2**20:.0f} MiB step\n",
             "| variant | median ms | x load_file | thread CPU ms |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {t * 1e3:.2f} | {r:.2f} | {c * 1e3:.2f} |" for n, t, r, c in walls.rows()]
    lines.append(f"\nload(verify=False) - load_file, median of per-round differences: "
                 f"{statistics.median(gaps) * 1e3:.2f} ms")
    return lines


# --------------------------------------------------------------------------- memory

_MEM_CHILD = r"""
import os, sys, json, torch
sys.path.insert(0, sys.argv[1])
from registry import Registry
import safetensors.torch as st
mib, work, what = int(sys.argv[2]), sys.argv[3], sys.argv[4]
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
state = {f"w{i}": torch.randn(mib * 2**20 // 4 // 64) for i in range(64)}
reg = Registry.open(url=f"sqlite:///{work}/m.db", root=f"{work}/root")
reg.publish("warm", 1, {"x": torch.randn(1000)})
st.save_file({"x": torch.randn(1000)}, f"{work}/warm.safetensors")
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
if what == "publish":
    reg.publish("run", 1, state)
elif what == "publish-async":
    reg.publish("run", 1, state, blocking=False).result()
else:
    st.save_file(state, f"{work}/m.safetensors")
peak = status("VmHWM")
print(json.dumps({"extra": peak - base, "size": sum(t.numel() * 4 for t in state.values())}))
"""


def bench_memory(mib: int, work: Path) -> list[str]:
    lines = ["", f"Peak extra RSS while saving a {mib} MiB CPU state dict (VmHWM after reset, minus VmRSS before):",
             "", "| save | extra MiB | % of state |", "|---|---:|---:|"]
    root = str(Path(__file__).resolve().parents[1])
    for what, label in (("publish", "registry publish (blocking)"), ("publish-async", "registry publish (async)"),
                        ("save_file", "safetensors save_file")):
        d = Path(tempfile.mkdtemp(dir=work))
        out = subprocess.run([sys.executable, "-c", _MEM_CHILD, root, str(mib), str(d), what],
                             capture_output=True, text=True, check=True)
        doc = json.loads(out.stdout.strip().splitlines()[-1])
        lines.append(f"| {label} | {doc['extra'] / 2**20:.1f} | {100 * doc['extra'] / doc['size']:.1f}% |")
        shutil.rmtree(d, ignore_errors=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", "1024")))
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the system disk)")
    parser.add_argument("--only", choices=["lazy"], default=None,
                        help="lazy: only a lazy load(verify=False) against load_file, and its parts")
    parser.add_argument("--url", default=None,
                        help="an empty catalog for --only lazy (default: a new SQLite file in --dir)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-io-", dir=args.dir))
    try:
        if args.only == "lazy":
            from sqlalchemy.engine import make_url
            url = f" --url {make_url(args.url).render_as_string(hide_password=True)}" if args.url else ""
            lines = [f"command: ./scripts/bench io --only lazy --mib {args.mib} --runs {args.runs}{url}",
                     f"load average at start: {os.getloadavg()[0]:.1f}",
                     (f"machine: {os.cpu_count()} cores; medians of {args.runs} rounds after a warm-up, "
                      "variants interleaved; ratios are medians of per-round ratios")]
            lines += bench_lazy(args.mib, work, args.runs, args.url)
            lines.append(f"\nload average at end: {os.getloadavg()[0]:.1f}")
            print("\n".join(lines))
            return
        lines = [f"command: ./scripts/bench io --mib {args.mib} --small {args.small} --runs {args.runs}",
                 f"load average at start: {os.getloadavg()[0]:.1f}",
                 f"machine: {os.cpu_count()} cores, torch {torch.__version__}; medians of {args.runs} rounds "
                 "after a warm-up; ratios are medians of per-round ratios"]
        for label, state in (("transformer", transformer_state(args.mib)), ("small", small_state(args.small))):
            d = work / label
            d.mkdir()
            lines += bench_workload(label, state, d, args.runs)
            del state
        lines += bench_memory(min(args.mib, 512), work)
        lines.append(f"\nload average at end: {os.getloadavg()[0]:.1f}")
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
