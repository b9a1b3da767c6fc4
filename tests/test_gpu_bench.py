"""benchmarks/gpu.py --cpu-smoke: every row of the GPU benchmark still runs, at tiny sizes on a CPU."""

import re
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

OK_ROWS = [("a", "gspo.py --model tiny"), ("a", "grpo.py --model tiny"), ("a", "ppo.py --model tiny"),
           ("b", "random checkpoint and --data"), ("b", "gspo.py"), ("b", "grpo.py"), ("b", "ppo.py"),
           ("d", "torchrun gspo.py"), ("d", "torchrun gspo.py --fsdp"), ("c", "common.sample"),
           ("c", "common.sample, temperature 1"), ("c", "HF model.generate"),
           *[("c", f"train step {a} {m}") for a in ("gspo", "grpo", "ppo") for m in ("chunked", "naive")]]  # fmt: skip


def test_cpu_smoke_table_has_every_row_and_every_row_passes():
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--cpu-smoke", "--time-budget", "1200"],  # a loaded machine skips none
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("\npart ") :]
    statuses = {}
    for part, name in OK_ROWS:
        found = re.findall(rf"^\({part}\)  {re.escape(name)} {{2,}}(\S+)", table, re.MULTILINE)
        assert len(found) == 1, f"row ({part}) {name}: {len(found)} lines in\n{table}"
        statuses[part, name] = found[0]
    failed = {row: status for row, status in statuses.items() if status != "ok"}
    assert not failed, f"{failed}\n{table}"
    assert len(re.findall(r"^\(\w\)  ", table, re.MULTILINE)) == len(OK_ROWS), table  # no other rows
