"""Checks that this environment holds every package of a pinned requirements file at its pinned version
(`pip freeze` against requirements.txt): a missing or drifted package fails here, as it would fail a newcomer.

    python tools/check_pins.py [requirements.txt]

A local build label is not a version: torch==2.13.0 is met by 2.13.0+cpu here and by a CUDA build of 2.13.0."""

import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement
from packaging.version import Version


def drift(pinned_file: str) -> list[str]:
    """One line per package of `pinned_file` not installed at its pinned version (empty: all are)."""
    problems = []
    for line in open(pinned_file):
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # the pinned file holds only name==version lines
        try:
            have = Version(version(req.name))
        except PackageNotFoundError:
            problems.append(f"{req.name}: pinned {spec.version}, not installed")
            continue
        if have.public != Version(spec.version).public:
            problems.append(f"{req.name}: pinned {spec.version}, installed {have}")
    return problems


if __name__ == "__main__":
    problems = drift(sys.argv[1] if len(sys.argv) > 1 else "requirements.txt")
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{'drift' if problems else 'every pin installed exactly'}: {len(problems)} package(s) differ")
    sys.exit(1 if problems else 0)
