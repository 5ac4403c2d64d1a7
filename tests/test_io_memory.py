"""A blocking publish streams tensors from their own memory: no second copy of the state dict.

Measured as peak RSS (VmHWM, reset just before the publish) in a fresh
subprocess. Page cache is not RSS, so this counts only what the process
allocates. The bound (10% of the state) is far above what a streaming writer
uses (~1 MiB) and far below a serialising one (100%), so it is not flaky.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

MIB = int(os.environ.get("REGISTRY_TEST_MEMORY_MIB", "64"))

CHILD = r"""
import json, sys, torch
from registry import Registry
mib, work = int(sys.argv[1]), sys.argv[2]
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
state = {f"w{i}": torch.randn(mib * 2**20 // 4 // 32) for i in range(32)}
state["t"] = torch.randn(64, 64).t()  # a small non-contiguous one is copied, and that is all
reg = Registry.open(url=f"sqlite:///{work}/c.db", root=f"{work}/root")
reg.publish("warm", 1, {"x": torch.randn(1000)})
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
reg.publish("run", 1, state, extra={"opt": {"m": torch.randn(1000)}})
print(json.dumps({"extra": status("VmHWM") - base, "size": sum(t.numel() * 4 for t in state.values())}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_blocking_publish_peak_memory_is_small(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(MIB), str(tmp_path)], capture_output=True, text=True,
                         env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["extra"] < 0.10 * doc["size"], doc
