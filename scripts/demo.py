"""The main job: a real (small) PyTorch training run published through the registry.

1. A trainer process trains an MLP on synthetic data, publishing every
   ``--every`` steps with its eval loss, and is SIGKILLed in the middle of
   publishing step ``--crash-at`` (after its files are written, before the
   rename), the way a preempted node dies.
2. A second trainer process resumes from ``demo@latest``: the half-written
   step is invisible to it, it restores weights, optimizer and RNG state, and
   trains to the end, publishing the steps again.
3. The run is summarised: every checkpoint with status and metrics, the best
   step by eval loss (tagged ``best-eval``), a verified reload, an fsck, and a
   retention policy that keeps the last two and the best step.

The demo works in a directory of its own (``--root``, default
``./demo-checkpoints``; ``$REGISTRY_ROOT`` and ``$REGISTRY_URL`` are ignored)
and marks it with a file, so that a later demo may start afresh there. It
never removes a directory without that mark, nor one holding other runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

RUN = "demo"
MARK = ".made-by-registry-demo"  # no run is named with a leading dot, so this file is never a run's
DEFAULT_ROOT = "demo-checkpoints"


def make_data(n: int = 2048, dim: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x[: n * 3 // 4], y[: n * 3 // 4], x[n * 3 // 4:], y[n * 3 // 4:]


def make_model(dim: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))


def train(args: argparse.Namespace) -> None:
    from registry import CheckpointNotFoundError, Registry, crashpoints

    torch.manual_seed(0)
    x_train, y_train, x_eval, y_eval = make_data()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    start = 0
    with Registry.open(root=args.root) as reg:
        try:
            ckpt = reg.load(f"{RUN}@latest")
        except CheckpointNotFoundError:
            print(f"[trainer pid {os.getpid()}] starting a new run")
        else:
            model.load_state_dict(ckpt.state_dict)
            opt.load_state_dict(ckpt.extra["optimizer"])
            sched.load_state_dict(ckpt.extra["scheduler"])
            torch.set_rng_state(ckpt.extra["rng"])
            start = ckpt.step or 0
            print(f"[trainer pid {os.getpid()}] resumed from {RUN}@{start} (verified)")

        g = torch.Generator().manual_seed(1234 + start)
        for step in range(start + 1, args.steps + 1):
            idx = torch.randint(0, len(x_train), (64,), generator=g)
            loss = nn.functional.mse_loss(model(x_train[idx]), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if step % 10 == 0:
                reg.log_metrics(RUN, step, {"train/loss": loss.item()})
            if step % args.every == 0:
                with torch.no_grad():
                    eval_loss = nn.functional.mse_loss(model(x_eval), y_eval).item()
                if step == args.crash_at:
                    print(f"[trainer pid {os.getpid()}] step {step}: killed mid-publish (SIGKILL)", flush=True)
                    crashpoints.arm("after-write")
                reg.publish(RUN, step, model.state_dict(),
                            extra={"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                   "rng": torch.get_rng_state()},
                            config={"dim": 32, "hidden": 128, "lr": 3e-3},
                            metrics={"eval/loss": eval_loss}, epoch=step * 64 // len(x_train),
                            consumed_samples=step * 64)
                print(f"[trainer pid {os.getpid()}] step {step}: eval/loss {eval_loss:.4f} published")


def summary(root: Path) -> None:
    from registry import Registry
    from registry.retention import KeepBest, KeepLast

    with Registry.open(root=root, create=False) as reg:
        best = reg.resolve(f"{RUN}@best:eval/loss")
        reg.tag(RUN, best.step, "best-eval")
        print(f"\nRun {RUN!r} in {reg.store.root}:")
        print(f"{'step':>6}  {'status':<9} {'eval/loss':>9}  {'size':>9}  tags")
        for info in reg.checkpoints(RUN, include_deleted=True):
            loss = info.metrics.get("eval/loss")
            print(f"{info.step:>6}  {info.status:<9} {loss if loss is None else f'{loss:9.4f}':>9}  "
                  f"{info.total_bytes / 1024:7.1f}KB  {','.join(info.tags)}")
        latest = reg.load(f"{RUN}@latest")
        events = [e.kind for e in reg.events(RUN)]
        print(f"\nlatest verified: step {latest.step}; best by eval/loss: step {best.step} "
              f"({best.metrics['eval/loss']:.4f}), tagged best-eval")
        print(f"events: {len(events)} ({', '.join(sorted(set(events)))})")
        hidden = sorted(p.name for p in (reg.store.root / RUN).iterdir() if p.name.startswith("."))
        print(f"hidden leftovers on disk: {hidden or 'none'}; fsck: "
              f"{'clean' if reg.fsck(checksums=True).clean else 'PROBLEMS'}")

        policy = KeepLast(2) | KeepBest(1, "eval/loss")
        plan = reg.plan_retention(RUN, policy)
        print(f"\nretention {policy!r}:")
        for step, why in plan.keep.items():
            print(f"  keep   {step:>4}  {why}")
        for step, why in plan.delete.items():
            print(f"  delete {step:>4}  {why}")
        result = plan.execute()
        print(f"deleted {sorted(result.deleted)}, freed {result.bytes_freed / 1024:.0f} KB; "
              f"their rows and metrics stay as history ({len(reg.metrics(RUN))} metric points)")


def prepare_root(root: Path, *, keep: bool) -> None:
    """Make ``root`` the demo's own, fresh directory, or exit with one line and leave it as it is.

    A directory the demo marked, holding no run but the demo's, is emptied
    (unless ``keep``); an empty directory is taken; anything else is refused.
    """
    from registry.format.refs import RUN_NAME_RE

    if root.exists() and not root.is_dir():
        sys.exit(f"demo: {root} is not a directory; pass --root DIR for a new one")
    if root.is_dir():
        entries = sorted(p.name for p in root.iterdir())
        others = [name for name in entries if name != RUN and RUN_NAME_RE.fullmatch(name) and (root / name).is_dir()]
        if others:
            sys.exit(f"demo: {root} holds other runs ({', '.join(others[:5])}); the demo leaves it alone: "
                     "pass --root DIR for a directory of its own")
        if entries and MARK not in entries:
            sys.exit(f"demo: {root} was not made by the demo (it has no {MARK}); the demo leaves it alone: "
                     "pass --root DIR for a directory of its own")
        if entries and not keep:
            shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARK).write_text("made by scripts/demo, which removes this directory when run again\n")


def shown(path: Path) -> str:
    """``path`` relative to the working directory where it is under it, for commands to copy."""
    try:
        return shlex.quote(str(path.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(path))


def next_commands(root: Path) -> list[str]:
    """Lines that work as printed: the venv's ``registry`` by its path, or after activating it."""
    args = f"--root {shown(root)}"
    if sys.prefix != sys.base_prefix:  # in a venv, such as the .venv that scripts/demo made
        bin_dir = Path(sys.prefix) / "bin"
        return [f"source {shown(bin_dir / 'activate')}      # once per shell, then:",
                f"registry {args} ls {RUN}",
                f"registry {args} metrics {RUN} --plot",
                f"registry {args} ui                # http://127.0.0.1:8765/",
                f"or, without activating: {shown(bin_dir / 'registry')} {args} ls {RUN}"]
    command = "registry" if shutil.which("registry") else f"{shlex.quote(sys.executable)} -m registry"
    return [f"{command} {args} ls {RUN}", f"{command} {args} metrics {RUN} --plot", f"{command} {args} ui"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None,
                        help=f"the demo's own directory (default ./{DEFAULT_ROOT}; $REGISTRY_ROOT is ignored)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--crash-at", type=int, default=200)
    parser.add_argument("--role", choices=["main", "trainer"], default="main")
    parser.add_argument("--keep", action="store_true", help="keep checkpoints from an earlier demo")
    args = parser.parse_args(argv)
    for name in ("REGISTRY_ROOT", "REGISTRY_URL", "REGISTRY_READ_ONLY"):  # the trainers inherit the environment
        if os.environ.pop(name, None) is not None and args.role == "main":
            print(f"demo: ignoring ${name}; the demo works in a directory of its own")
    if args.role == "trainer":
        train(args)
        return

    root = (args.root or Path.cwd() / DEFAULT_ROOT).absolute()
    prepare_root(root, keep=args.keep)
    child = [sys.executable, __file__, "--role", "trainer", "--root", str(root), "--steps", str(args.steps),
             "--every", str(args.every), "--crash-at", str(args.crash_at)]
    t0 = time.perf_counter()
    first = subprocess.run(child)
    if first.returncode != -signal.SIGKILL:
        sys.exit(f"expected the first trainer to be killed, it exited with {first.returncode}")
    print("-- trainer died with SIGKILL; starting a new one\n")
    second = subprocess.run(child[:-2] + ["--crash-at", "-1"])
    if second.returncode != 0:
        sys.exit(second.returncode)
    summary(root)
    print(f"\ndone in {time.perf_counter() - t0:.1f}s. Next:")
    for line in next_commands(root):
        print(f"  {line}")


if __name__ == "__main__":
    main()
