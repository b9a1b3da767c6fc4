"""Benchmark: the figures of issue 39's "Done when" (the core and its extras), measured on this checkout.

    pip install coverage   # for the coverage figure (the rest needs nothing)
    python benchmarks/layout.py [--skip-coverage] [--scripts ppo grpo gspo]

Prints, each beside its bar: the line counts of common.py, of each extras/ module and of the scripts;
each script's train() in lines (all of them, and code lines: neither blank nor comment-only); the length
of `diff grpo.py gspo.py`; the README's word count (whitespace-separated, as `wc -w`); whether a loss
signature has `trace`; and the share of common.py's statements that a 3-step default run of each script
plus one --resume of each executes (coverage.py: `--steps 3 --save-every 3`, then `--resume OUT --steps 4`,
each in its own process). The runs take a few minutes on 2 CPU cores, one thread each (RLREF_THREADS).
Not collected by pytest.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("ppo", "grpo", "gspo")
SCRIPT_BARS = {"gspo": 250, "grpo": 290, "ppo": 340}
COMMON_BAR, COMMON_FALLBACK, TRAIN_BAR, DIFF_BAR, README_BAR, COVERAGE_BAR = 2000, 2200, 80, 200, 1500, 75.0


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def function_lines(path: Path, name: str) -> tuple[int, int]:
    """(all lines, code lines) of the top-level function `name`, from its def to its last line."""
    source = path.read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    body = source.splitlines()[node.lineno - 1 : node.end_lineno]
    code = [line for line in body if line.strip() and not line.strip().startswith("#")]
    return len(body), len(code)


def loss_signatures_with_trace(script: str) -> list[str]:
    """The loss functions (names ending in _loss) of `script` whose parameters include `trace`."""
    tree = ast.parse((ROOT / f"{script}.py").read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_loss"):
            params = [a.arg for a in node.args.args + node.args.kwonlyargs]
            if "trace" in params:
                found.append(f"{script}.{node.name}")
    return found


def row(figure: str, measured, bar: str = "", ok: bool | None = None):
    mark = "" if ok is None else ("ok" if ok else "OVER")
    print(f"  {figure:<44} {measured!s:>10}  {bar:<22} {mark}")


def coverage_of_common(scripts, threads: str) -> tuple[float, int, int, float]:
    """(percent, executed statements, statements, seconds) of common.py over a 3-step default run and a
    --resume of each script, each under `coverage run` in its own process, combined."""
    import coverage

    work = Path(tempfile.mkdtemp(prefix="layout-coverage-"))
    env = dict(os.environ, RLREF_THREADS=threads, HF_HUB_OFFLINE="1")
    env.pop("PYTHONWARNINGS", None)
    start = time.perf_counter()
    try:
        for script in scripts:
            out = work / script
            for argv in (["--steps", "3", "--save-every", "3", "--out", out], ["--resume", out, "--steps", "4"]):
                cmd = [sys.executable, "-m", "coverage", "run", "-p", f"--data-file={work / '.coverage'}",
                       f"--include={ROOT / 'common.py'}", f"{script}.py", *map(str, argv)]  # fmt: skip
                print(f"  running: {script}.py {' '.join(map(str, argv))}", file=sys.stderr, flush=True)
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        cov = coverage.Coverage(data_file=str(work / ".coverage"))
        cov.combine([str(work)], keep=False)
        cov.load()
        _, statements, _, missing, _ = cov.analysis2(str(ROOT / "common.py"))
        executed = len(statements) - len(missing)
        return 100.0 * executed / len(statements), executed, len(statements), time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), help="the scripts the coverage runs drive")
    parser.add_argument("--skip-coverage", action="store_true", help="only the figures read from the files")
    parser.add_argument("--threads", default="1", help="RLREF_THREADS of each coverage run")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    print(f"issue 39's figures at {commit.stdout.strip() or '?'}{' (uncommitted changes)' if dirty else ''}")

    print("\nsizes (lines)")
    n_common = lines(ROOT / "common.py")
    row("common.py", n_common, f"<= {COMMON_BAR} ({COMMON_FALLBACK})", n_common <= COMMON_FALLBACK)
    extras = sorted((ROOT / "extras").glob("*.py"))
    for path in extras:
        row(f"extras/{path.name}", lines(path))
    row("extras/ in all", sum(lines(p) for p in extras))
    for script in SCRIPTS:
        n = lines(ROOT / f"{script}.py")
        row(f"{script}.py", n, f"<= {SCRIPT_BARS[script]}", n <= SCRIPT_BARS[script])

    print("\nthe scripts")
    for script in SCRIPTS:
        total, code = function_lines(ROOT / f"{script}.py", "train")
        row(f"{script}.py train(): lines (code lines)", f"{total} ({code})", f"<= {TRAIN_BAR}", total <= TRAIN_BAR)
    diff = subprocess.run(["diff", "grpo.py", "gspo.py"], cwd=ROOT, capture_output=True, text=True).stdout
    n_diff = len(diff.splitlines())
    row("diff grpo.py gspo.py | wc -l", n_diff, f"<= {DIFF_BAR}", n_diff <= DIFF_BAR)
    traced = [name for script in SCRIPTS for name in loss_signatures_with_trace(script)]
    row("loss signatures with trace", ", ".join(traced) or "none", "none", not traced)
    words = len((ROOT / "README.md").read_text().split())
    row("README.md words (wc -w)", words, f"<= {README_BAR}", words <= README_BAR)

    print("\ncoverage of common.py: a 3-step default run (--save-every 3) and one --resume (--steps 4) of each script")
    if args.skip_coverage:
        print("  (skipped: --skip-coverage)")
        return
    try:
        import coverage  # noqa: F401
    except ImportError:
        print("  (coverage.py is not installed: pip install coverage)")
        return
    percent, executed, statements, seconds = coverage_of_common(args.scripts, args.threads)
    row(f"statements executed ({' '.join(args.scripts)})", f"{percent:.1f}%", f">= {COVERAGE_BAR:.0f}%",
        percent >= COVERAGE_BAR)  # fmt: skip
    print(f"  ({executed} of {statements} statements; {len(args.scripts) * 2} runs in {seconds:.0f} s)")


if __name__ == "__main__":
    main()
