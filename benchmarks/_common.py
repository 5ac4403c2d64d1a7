"""What the benches share: the state dicts they time, a free port for a gloo group, the process's memory.

Each bench runs as a script (``./scripts/bench NAME`` runs ``benchmarks/bench_NAME.py``), so this folder is
first on ``sys.path`` and ``from _common import ...`` finds this module.
"""

from __future__ import annotations

import gc
import os
import socket
from pathlib import Path
from typing import Any

import torch


def settle() -> None:
    """A full garbage collection and a ``sync`` before a timed variant, outside its timing.

    The rounds allocate alike, so without the collection the interpreter's
    full collection lands on the same variant every round and bills it for
    the whole bench's garbage (seen: a 9 ms lazy load timed at 176 ms, a
    publish at twice the floor). The ``sync`` writes out what the last
    variant left dirty and never fsync'd (the S3 server's volume files), which
    the kernel would otherwise flush 30 s later, inside whichever variant runs
    then.
    """
    gc.collect()
    os.sync()


def transformer_state(mib: int) -> dict[str, torch.Tensor]:
    """A decoder-only transformer's weights (fp32), scaled in depth to about ``mib`` MiB."""
    hidden, vocab = 1024, 32000
    per_layer = 12 * hidden * hidden + 2 * hidden
    layers = max(1, round((mib * 2**20 / 4 - 2 * vocab * hidden) / per_layer))
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        state[p + "attn.qkv.weight"] = torch.randn(3 * hidden, hidden, generator=g)
        state[p + "attn.out.weight"] = torch.randn(hidden, hidden, generator=g)
        state[p + "mlp.up.weight"] = torch.randn(4 * hidden, hidden, generator=g)
        state[p + "mlp.down.weight"] = torch.randn(hidden, 4 * hidden, generator=g)
        state[p + "norm1.weight"] = torch.ones(hidden)
        state[p + "norm2.weight"] = torch.ones(hidden)
    state["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    return state


def small_state(count: int) -> dict[str, torch.Tensor]:
    """``count`` small tensors (16 to 8,192 floats): the many-files, metadata-bound case."""
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(16, 8192, (count,), generator=g).tolist()
    return {f"t{i:05d}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(field: str) -> int:
    """A ``/proc/self/status`` memory figure (``VmRSS``, ``VmHWM``, ``RssAnon``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def print_rates(times: dict[str, list[float]], ratios: dict[str, list[float]], *, mib: float,
                no_rate: tuple[str, ...] = ()) -> None:
    """The table the object-store benches print: each variant's median seconds and MiB/s (none for ``no_rate``),
    then each ratio's median with its per-round values."""
    import statistics
    print(f"{'variant':<30} {'seconds':>9} {'MiB/s':>8}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:<30} {med:>9.3f} {mib / med if k not in no_rate else float('nan'):>8.0f}")
    for k, v in ratios.items():
        print(f"{k:<30} {statistics.median(v):>9.3f}  (per round: {', '.join(f'{x:.2f}' for x in v)})")


def s3_bench_server(work: Path) -> Any:
    """The S3 server an object-store bench talks to: the one ``REGISTRY_TEST_S3_ENDPOINT`` names (its credentials
    in the AWS environment), else a private SeaweedFS under ``work`` whose credentials go into this process's
    environment. Stop it with ``server.stop()`` when ``server.process`` is set."""
    from tests import s3server
    if os.environ.get("REGISTRY_TEST_S3_ENDPOINT"):
        return s3server.Server(endpoint=os.environ["REGISTRY_TEST_S3_ENDPOINT"])
    server = s3server.start(work / "seaweedfs")
    os.environ.update(server.env)
    return server
