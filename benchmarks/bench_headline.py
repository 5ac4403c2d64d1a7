"""The headline: one row per job, the registry against the tools a user would pick instead, all in this run.

Every ratio is the median over rounds of (the registry's time / the tool's
time in the same round), after one warm-up round; within a group the
variants run round-robin in an order rotated every round, so that noise from
other processes hits them all alike. Saves end in fsync for every variant
(``dcp.save`` fsyncs itself), each save's output is deleted before the next
variant runs, loads read files just written (page cache warm for all).

Groups (each reuses the dedicated bench's workloads and helpers):

* one process, a transformer-shaped fp32 state dict of ``--mib`` MiB: blocking
  publish, async publish (until the call returns), a dedup hit, verified and
  lazy loads, ``diff`` of two steps that differ in one element, against
  safetensors ``save_file``/``load_file``, ``torch.save``/``torch.load``,
  ``torch.distributed.checkpoint`` ``save``/``async_save``/``load`` and the
  reference module (``../shared/seed/checkpoint_reference.py``, ``Checkpoint``);
* Lightning ``trainer.save_checkpoint`` with its own ``TorchCheckpointIO``
  (then fsync) against the same call with ``RegistryCheckpointIO``, and the
  Hugging Face ``Trainer._save_checkpoint`` of a tiny Llama (``--hf-mib``),
  then fsync, against the same save published by ``RegistryCallback``
  (blocking, and with ``blocking=False`` the time the Trainer is blocked);
* 2 ranks on gloo (``--dist-mib``): a broadcast load (``bench distributed``'s
  rank loop) and a sharded FSDP2 publish and load (``bench sharded``'s rank
  loop), small variants of those benches run here;
* resolve on a SQLite catalog of ``--checkpoints`` steps (``bench queries``'s
  catalog), against finding the newest step by listing a run's directory.

    ./scripts/bench headline [--only one,trainers,ranks,resolve] [--mib 256] [--dist-mib 256] [--hf-mib 64]
                             [--checkpoints 100000] [--runs 5]
    ./scripts/bench headline --mib 1024 --dist-mib 1024   # bigger (needs ~6x --mib of free memory)

The state dicts cannot go below ~260 MiB (``transformer_state``'s embedding
and head); each row names the headline group that reproduces it and the
area's own bench, which has the full-size figures and more variants.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import safetensors.torch as st
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_distributed  # noqa: E402
import bench_sharded  # noqa: E402
from _common import settle, transformer_state  # noqa: E402
from bench_io import Table, fsync_path, fsync_tree, reference_load, reference_save, timed, touch_all  # noqa: E402
from bench_lineage import publish_diff_pair  # noqa: E402

from registry import Registry  # noqa: E402

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
GROUPS = ("one", "trainers", "ranks", "resolve")
SEED = REPO.parent / "shared" / "seed" / "checkpoint_reference.py"


# --------------------------------------------------------------------------- measuring


def interleaved(variants: dict[str, Callable[[], float]], runs: int, *,
                before: Callable[[], None] = lambda: None) -> Table:
    """Each variant returns the seconds it took; round 0 warms up; the order rotates every round."""
    table = Table(next(iter(variants)))
    names = list(variants)
    for round_ in range(runs + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            before()
            settle()
            cpu0 = time.process_time()
            seconds = variants[name]()
            if round_:
                table.add(name, seconds, time.process_time() - cpu0)
    return table


class Outputs:
    """A save variant's output folder, emptied before every variant, and the published steps removed with it,
    so that no variant pays for the page cache or disk blocks another one left behind."""

    def __init__(self, folder: Path, *, make: bool = True) -> None:
        self.folder, self.make = folder, make
        self.published: list[Path] = []

    def clean(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.make:
            self.folder.mkdir()
        while self.published:
            shutil.rmtree(self.published.pop(), ignore_errors=True)


@dataclass(frozen=True)
class Row:
    """One headline row: the registry's median, and its per-round ratio to each tool's time."""

    job: str
    ours: float
    against: tuple[tuple[str, float], ...]
    command: str  # the headline group that measured it
    dedicated: str = ""  # the area's own bench, for its full figures


def per_round(times: dict[str, list[float]], ours: str, tools: dict[str, str]) -> tuple[tuple[str, float], ...]:
    """(label, median over rounds of ours / tool) for each ``label: variant name`` in ``tools``."""
    return tuple((label, statistics.median(a / b for a, b in zip(times[ours], times[name])))
                 for label, name in tools.items())


def reference_module() -> ModuleType | None:
    """The seed's reference module itself, when this checkout sits beside ``shared/``."""
    if not SEED.is_file():
        return None
    spec = importlib.util.spec_from_file_location("checkpoint_reference", SEED)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- one process


def single_process(mib: int, runs: int, work: Path, cmd: str) -> list[Row]:
    import torch.distributed.checkpoint as dcp
    ref_mod = reference_module()
    state = transformer_state(mib)
    outputs = Outputs(work / "out")
    out, published, clean = outputs.folder, outputs.published, outputs.clean
    reg = Registry.open(url=f"sqlite:///{work / 'catalog.db'}", root=work / "root")
    steps = iter(range(1, 10**9))

    def publish() -> float:
        return timed(lambda: published.append(reg.publish("pub", next(steps), state).path))

    def publish_async() -> float:
        t0 = time.perf_counter()
        future = reg.publish("pub", next(steps), state, blocking=False)
        returned = time.perf_counter() - t0
        published.append(future.result().path)
        return returned

    # a dedup hit: the same bytes as two live steps of the run (the fallback rule keeps the newest two apart,
    # so there are two inodes to alternate between); hits are links, kept until the end
    reg.publish("dd", 0, state, dedup=True)
    reg.publish("dd", 1, state, dedup=True)
    dd_steps = iter(range(2, 10**9))

    def dedup_hit() -> float:
        return timed(lambda: reg.publish("dd", next(dd_steps), state, dedup=True))

    def save_file() -> float:
        return timed(lambda: (st.save_file(state, str(out / "m.safetensors")), fsync_path(out / "m.safetensors"),
                              fsync_path(out)))

    def torch_save() -> float:
        return timed(lambda: (torch.save(state, out / "m.pt"), fsync_path(out / "m.pt"), fsync_path(out)))

    def dcp_save() -> float:
        return timed(lambda: dcp.save(state, checkpoint_id=out / "dcp"))

    def dcp_async() -> float:
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=out / "dcp-async")
        returned = time.perf_counter() - t0
        future.result()
        return returned

    def reference() -> float:
        if ref_mod is None:
            return timed(lambda: reference_save(out / "ref", state))
        return timed(lambda: ref_mod.Checkpoint(state_dict=state).save(str(out / "ref")))

    saves = {"publish": publish, "publish async (returned)": publish_async, "dedup hit": dedup_hit,
             "save_file+fsync": save_file, "torch.save+fsync": torch_save, "dcp.save": dcp_save,
             "dcp.async_save (returned)": dcp_async, "reference save": reference}
    s = interleaved(saves, runs, before=clean).times
    hit = reg.resolve("dd@3").path / "model.safetensors"
    linked = os.stat(hit).st_nlink

    # loads: files written once, read by every variant in every round
    clean()
    reg.publish("load", 1, state)
    st.save_file(state, str(out / "m.safetensors"))
    torch.save(state, out / "m.pt")
    dcp.save(state, checkpoint_id=out / "dcp")
    if ref_mod is None:
        reference_save(out / "ref", state)
    else:
        ref_mod.Checkpoint(state_dict=state).save(str(out / "ref"))
    template = {k: torch.empty_like(v) for k, v in state.items()}
    publish_diff_pair(reg, mib, 16)
    diff_a, diff_b = (str(reg.resolve(f"diff@{i}").path / "model.safetensors") for i in (1, 2))

    def compare_files() -> list[str]:
        x, y = st.load_file(diff_a), st.load_file(diff_b)
        return [k for k in x if not torch.equal(x[k], y[k])]

    def ref_load(verify: bool) -> Callable[[], object]:
        if ref_mod is None:
            return (lambda: reference_load(out / "ref")) if verify else (
                lambda: st.load_file(str(out / "ref" / "model.safetensors")))
        return lambda: ref_mod.Checkpoint.load(str(out / "ref"), verify_checksums=verify)

    loads: dict[str, Callable[[], object]] = {
        "load(verify=True)": lambda: reg.load("load@1", verify=True),
        "load(verify=False)": lambda: reg.load("load@1", verify=False),
        "load_file": lambda: st.load_file(str(out / "m.safetensors")),
        "load_file + touch": lambda: touch_all(st.load_file(str(out / "m.safetensors"))),
        "torch.load": lambda: torch.load(out / "m.pt", weights_only=True, mmap=True),
        "torch.load (read)": lambda: torch.load(out / "m.pt", weights_only=True),
        "dcp.load": lambda: dcp.load(template, checkpoint_id=out / "dcp"),
        "reference load (verify_checksums)": ref_load(True),
        "reference load": ref_load(False),
        "diff": lambda: reg.diff("diff@1", "diff@2"),
        "load_file both + torch.equal": compare_files,
    }
    lt = interleaved({k: (lambda fn=fn: timed(fn)) for k, fn in loads.items()}, runs).times  # type: ignore[misc]
    reg.close()
    clean()
    med = statistics.median
    ref_label = "reference Checkpoint" if ref_mod is not None else "reference algorithm (seed module not found)"
    size = f"{len(template)} tensors, {sum(t.numel() * t.element_size() for t in template.values()) / 2**20:.0f} MiB"
    lazy_gap = med(1e3 * (x - y) for x, y in zip(lt["load(verify=False)"], lt["load_file"]))
    return [
        Row(f"blocking publish, {size}", med(s["publish"]), per_round(s, "publish", {
            "save_file+fsync": "save_file+fsync", "torch.save+fsync": "torch.save+fsync", "dcp.save": "dcp.save",
            f"{ref_label}.save": "reference save"}), cmd, "./scripts/bench io --mib 1024"),
        Row("async publish: time the trainer is blocked", med(s["publish async (returned)"]),
            per_round(s, "publish async (returned)", {
                "dcp.async_save (returned)": "dcp.async_save (returned)", "save_file+fsync": "save_file+fsync",
                "blocking publish": "publish"}), cmd, "./scripts/bench async"),
        Row(f"dedup hit (same bytes as a live step; {linked} links to the file)", med(s["dedup hit"]),
            per_round(s, "dedup hit", {"fresh blocking publish": "publish", "save_file+fsync": "save_file+fsync"}),
            cmd, "./scripts/bench lineage --only dedup"),
        Row("verified load (xxh3 pieces checked)", med(lt["load(verify=True)"]), per_round(lt, "load(verify=True)", {
            f"{ref_label}.load(verify_checksums=True)": "reference load (verify_checksums)",
            "torch.load (read)": "torch.load (read)", "dcp.load": "dcp.load",
            "load_file + read every page (unverified)": "load_file + touch"}),
            cmd, "./scripts/bench io --mib 1024"),
        Row(f"lazy load, verify=False (load_file + {lazy_gap:.2f} ms)", med(lt["load(verify=False)"]),
            per_round(lt, "load(verify=False)", {"load_file": "load_file", "torch.load(mmap=True)": "torch.load",
                                                 f"{ref_label}.load": "reference load"}),
            cmd, "./scripts/bench io --only lazy"),
        Row("diff of two steps (one element differs)", med(lt["diff"]), per_round(lt, "diff", {
            "load_file both + torch.equal": "load_file both + torch.equal",
            "one verified load": "load(verify=True)"}), cmd, "./scripts/bench lineage --only diff"),
    ]


# --------------------------------------------------------------------------- trainers


def _lightning(mib: int, runs: int, work: Path, cmd: str) -> Row:
    import lightning.pytorch as pl

    from registry.integrations.lightning import RegistryCheckpointIO

    width = 1024
    layers = max(1, (mib << 20) // (3 * 4 * width * width))  # weights + AdamW's two moments

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    reg = Registry.open(url=f"sqlite:///{work / 'lightning.db'}", root=work / "lightning-root")
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         plugins=[RegistryCheckpointIO(reg)], default_root_dir=str(work / "pl"))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2, width)), batch_size=2)
    trainer.fit(Model(), data)
    steps = iter(range(1, 10**9))
    outputs = Outputs(work / "pl-out")
    out, published, clean = outputs.folder, outputs.published, outputs.clean

    def ours() -> float:
        step = next(steps)
        seconds = timed(lambda: trainer.save_checkpoint(f"registry:pl@{step}"))
        published.append(reg.resolve(f"pl@{step}").path)
        return seconds

    def theirs() -> float:
        return timed(lambda: (trainer.save_checkpoint(out / "last.ckpt"), fsync_path(out / "last.ckpt"),
                              fsync_path(out)))

    times = interleaved({"registry": ours, "lightning": theirs}, runs, before=clean).times
    reg.close()
    clean()
    size = sum(p.numel() for p in trainer.lightning_module.parameters()) * 4 * 3 / 2**20
    return Row(f"Lightning trainer.save_checkpoint, {layers} Linear + AdamW, {size:.0f} MiB",
               statistics.median(times["registry"]),
               per_round(times, "registry", {"TorchCheckpointIO + fsync": "lightning"}), cmd)


def _hugging_face(mib: int, runs: int, work: Path, cmd: str) -> list[Row]:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from registry.integrations.transformers import RegistryCallback

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hidden = 512
    per_layer = 12 * hidden * hidden * 4 * 3  # the layer's weights + AdamW's two moments, fp32
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=max(1, (mib << 20) // per_layer), num_attention_heads=8,
                         num_key_value_heads=8, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    rows = torch.randint(0, 1024, (4, 16), generator=torch.Generator().manual_seed(0))

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": rows[i], "labels": rows[i]}

    out = work / "hf"
    args = TrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=2, save_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True, logging_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    with contextlib.redirect_stdout(io.StringIO()):  # its end-of-training metrics, not this bench's table
        trainer.train()
    reg = Registry.open(url=f"sqlite:///{work / 'hf.db'}", root=work / "hf-root")
    callback = RegistryCallback(reg, "hf")
    background = RegistryCallback(reg, "hf-background", blocking=False)
    steps = iter(range(1, 10**9))
    outputs = Outputs(out, make=False)  # the Trainer makes its output folder
    published, clean = outputs.published, outputs.clean

    def save() -> Path:
        trainer.state.global_step = next(steps)
        trainer._save_checkpoint(trainer.model, trial=None)
        return out / f"checkpoint-{trainer.state.global_step}"

    def ours() -> float:
        def run() -> None:
            folder = save()
            callback.publish_directory(folder, step=trainer.state.global_step, epoch=0)
        seconds = timed(run)
        published.append(reg.resolve(f"hf@{trainer.state.global_step}").path)
        return seconds

    def ours_background() -> float:
        def run() -> None:
            folder = save()
            background.publish_directory(folder, step=trainer.state.global_step, epoch=0)
        seconds = timed(run)
        reg.wait()  # untimed: the adoption ends before the next variant starts
        background._remove_published(wait=True)
        published.append(reg.resolve(f"hf-background@{trainer.state.global_step}").path)
        return seconds

    def theirs() -> float:
        return timed(lambda: fsync_tree(save()))

    size = sum(p.numel() * p.element_size() for p in model.parameters())
    times = interleaved({"registry": ours, "background": ours_background, "hf": theirs}, runs, before=clean).times
    reg.close()
    clean()
    return [Row(f"Hugging Face Trainer._save_checkpoint, Llama {size / 2**20:.0f} MiB + AdamW",
                statistics.median(times["registry"]),
                per_round(times, "registry", {"_save_checkpoint + fsync": "hf"}), cmd),
            Row("Hugging Face callback, blocking=False: time the Trainer is blocked",
                statistics.median(times["background"]),
                per_round(times, "background", {"_save_checkpoint + fsync": "hf", "blocking callback": "registry"}),
                cmd)]


# --------------------------------------------------------------------------- two ranks


def two_ranks(mib: int, runs: int, cmd: str) -> list[Row]:
    ranks, sizes = bench_distributed.measure(size_mib=mib, small=200, repeats=runs)
    d = {k.split(":", 1)[1]: v for k, v in ranks[0].items() if k.startswith("big:")}
    broadcast = Row(f"broadcast load to 2 ranks, {sizes['big'][1] / 2**20:.0f} MiB (gloo, verify=False)",
                    statistics.median(d["ours/broadcast"]),
                    per_round(d, "ours/broadcast", {
                        "reference load_state_dict(broadcast=True)": "reference (per tensor)",
                        "one flat broadcast of the file (floor)": "floor (flat broadcast)"}),
                    cmd, "./scripts/bench distributed --size-mib 1024")
    sharded = bench_sharded.measure(size_mib=mib, repeats=runs, world=2)
    t = sharded[0]["rounds"]
    return [
        broadcast,
        Row(f"sharded publish, 2 ranks FSDP2 + AdamW, {sum(r['shard_bytes'] for r in sharded) / 2**20:.0f} MiB",
            statistics.median(t["publish/ours"]),
            per_round(t, "publish/ours", {"dcp.save + fsync": "publish/dcp",
                                          "gather to rank 0 + publish": "publish/gather"}),
            cmd, "./scripts/bench sharded --size-mib 1024"),
        Row("sharded async publish: time the trainer is blocked", statistics.median(t["publish/async"]),
            per_round(t, "publish/async", {"dcp.async_save (returned)": "publish/dcp-async",
                                           "dcp.save + fsync": "publish/dcp"}),
            cmd, "./scripts/bench sharded --size-mib 1024"),
        Row("sharded load (load_into, pieces checked)", statistics.median(t["load/ours"]),
            per_round(t, "load/ours", {"dcp.load": "load/dcp"}),
            cmd, "./scripts/bench sharded --size-mib 1024"),
    ]


# --------------------------------------------------------------------------- resolve


def resolve(checkpoints: int, runs: int, work: Path, cmd: str) -> list[Row]:
    """The catalog's resolve against what a run without one does: list its step folders, read their metrics."""
    import json

    import bench_queries

    from registry.catalog import Catalog
    from registry.format.refs import parse_ref
    catalog = Catalog.open(f"sqlite:///{work / 'queries.db'}")
    runs_n = max(1, min(100, checkpoints // 20))  # bench queries' 100 runs; fewer for a small catalog
    bench_queries.build(catalog, checkpoints=checkpoints, runs=runs_n, metrics=10)
    per_run = checkpoints // runs_n
    folder = work / "listing" / "run000"
    g = random.Random(0)
    for i in range(per_run):
        step = folder / f"step-{(i + 1) * 100:08d}"
        step.mkdir(parents=True)
        (step / "metrics.json").write_text(json.dumps({bench_queries.BEST_KEY: g.random()}))
    rng = random.Random(0)
    calls = 50

    def newest_by_listing() -> int:
        return max(int(e.name[5:]) for e in os.scandir(folder) if e.name.startswith("step-"))

    def best_by_files() -> str:
        return min((json.loads((Path(e.path) / "metrics.json").read_bytes())[bench_queries.BEST_KEY], e.name)
                   for e in os.scandir(folder))[1]

    def resolving(selector: str) -> Callable[[], float]:
        refs = [parse_ref(f"run{r:03d}@{selector}") for r in range(runs_n)]

        def run() -> float:
            picks = [rng.choice(refs) for _ in range(calls)]
            return timed(lambda: [catalog.resolve(r) for r in picks]) / calls
        return run

    times = interleaved({"latest": resolving("latest"), "listing": lambda: timed(newest_by_listing),
                         "best": resolving(f"best:{bench_queries.BEST_KEY}"), "files": lambda: timed(best_by_files)},
                        max(runs, 7)).times
    catalog.close()
    extra = f"./scripts/bench queries --checkpoints {checkpoints} (both backends, every selector)"
    return [
        Row(f"resolve @latest, SQLite catalog of {checkpoints:,} checkpoints", statistics.median(times["latest"]),
            per_round(times, "latest", {f"listing a run's {per_run} step folders for the newest": "listing"}),
            cmd, extra),
        Row(f"resolve @best:{bench_queries.BEST_KEY}, same catalog", statistics.median(times["best"]),
            per_round(times, "best", {f"reading the {per_run} folders' metrics.json for the best": "files"}),
            cmd, extra),
    ]


# --------------------------------------------------------------------------- output


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 0.1 else f"{s:.3f} s"


def table(rows: list[Row]) -> list[str]:
    lines = ["| job | registry, median | registry / tool, same run (median of per-round ratios) | reproduce | "
             "the area's own bench |", "|---|---:|---|---|---|"]
    for r in rows:
        ratios = "; ".join(f"{label} **{x:.2f}x**" for label, x in r.against)
        lines.append(f"| {r.job} | {fmt_seconds(r.ours)} | {ratios} | `{r.command}` | "
                     f"{f'`{r.dedicated}`' if r.dedicated else ''} |")
    return lines


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", "256")),
                        help="the one-process state dict")
    parser.add_argument("--dist-mib", type=int, default=256, help="the 2-rank state (both ranks together)")
    parser.add_argument("--hf-mib", type=int, default=64, help="the trainers' model + optimizer state")
    parser.add_argument("--checkpoints", type=int, default=100_000, help="the resolve catalog (0: skip)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups to run: {','.join(GROUPS)}")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the system disk)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    only = [g for g in GROUPS if g in set(args.only.split(","))]
    if not only or set(args.only.split(",")) - set(GROUPS):
        parser.error(f"--only takes groups among {','.join(GROUPS)}")
    runs = f" --runs {args.runs}"
    cmd = {"one": f"./scripts/bench headline --only one --mib {args.mib}{runs}",
           "trainers": f"./scripts/bench headline --only trainers --hf-mib {args.hf_mib}{runs}",
           "ranks": f"./scripts/bench headline --only ranks --dist-mib {args.dist_mib}{runs}",
           "resolve": f"./scripts/bench headline --only resolve --checkpoints {args.checkpoints}{runs}"}
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-headline-", dir=args.dir))
    rows: list[Row] = []
    try:
        for group in only:
            (work / group).mkdir()
            if group == "one":
                rows += single_process(args.mib, args.runs, work / group, cmd[group])
            elif group == "trainers":
                rows.append(_lightning(args.hf_mib, args.runs, work / group, cmd[group]))
                rows.extend(_hugging_face(args.hf_mib, args.runs, work / group, cmd[group]))
            elif group == "ranks":
                rows += two_ranks(args.dist_mib, args.runs, cmd[group])
            elif args.checkpoints:
                rows += resolve(args.checkpoints, args.runs, work / group, cmd[group])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    print(f"command: ./scripts/bench headline --only {','.join(only)} --mib {args.mib} --dist-mib {args.dist_mib} "
          f"--hf-mib {args.hf_mib} --checkpoints {args.checkpoints} --runs {args.runs}")
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit()}; machine: {os.cpu_count()} "
          f"cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, torch "
          f"{torch.__version__}; load average at start {load0[0]:.1f} / {load0[1]:.1f}, at end {load1[0]:.1f} / "
          f"{load1[1]:.1f} (1 / 5 min); {time.perf_counter() - t0:.0f} s in all")
    print(f"medians of {args.runs} rounds after a warm-up, variants interleaved; a ratio below 1 means the "
          "registry took less time\n")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
