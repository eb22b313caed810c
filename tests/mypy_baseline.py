"""Type-check runtime/ and operator/ with mypy against a baseline that may only shrink.

    python -P tests/mypy_baseline.py            # exit 1 on a new error, or on a fixed one still listed
    python -P tests/mypy_baseline.py --update   # rewrite tests/mypy_baseline.txt after fixing errors

The baseline lists today's errors as ``path: [code] message`` without line numbers, so edits that move
code do not churn it; a count per line covers the same error appearing several times in one file.
The source directories do not carry their import names (``runtime/`` is ``sluice.runtime``), and an
editable install's import hook is invisible to mypy, so the script links them into
``.mypy_cache/src/sluice/`` and checks them as packages from there (cache in ``.mypy_cache``).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "mypy_baseline.txt"
LINKS = ROOT / ".mypy_cache" / "src"
PACKAGES = {"runtime": "sluice.runtime", "operator": "sluice.operator"}
ERROR = re.compile(r"^(?P<path>[^:]+):\d+(?::\d+)?: error: (?P<message>.*?)(?:  \[(?P<code>[a-z-]+)\])?$")
UPDATE_HINT = "python -P tests/mypy_baseline.py --update"


def _link_tree() -> None:
    package_root = LINKS / "sluice"
    package_root.mkdir(parents=True, exist_ok=True)
    for directory in PACKAGES:
        link, target = package_root / directory, ROOT / directory
        if link.is_symlink() and link.readlink() == target:
            continue
        if link.is_symlink():
            link.unlink()  # a cache copied from another checkout: check this one's sources
        link.symlink_to(target, target_is_directory=True)


def normalise(output: str) -> collections.Counter[str]:
    """mypy's error lines as ``path: [code] message`` (paths relative to the checkout), counted."""
    found: collections.Counter[str] = collections.Counter()
    prefix = str(LINKS / "sluice") + os.sep
    for line in output.splitlines():
        match = ERROR.match(line)
        if match is None:
            continue
        path = str((ROOT / match["path"]).absolute()) if not os.path.isabs(match["path"]) else match["path"]
        path = path.replace(prefix, "", 1) if path.startswith(prefix) else os.path.relpath(path, ROOT)
        found[f"{path}: [{match['code'] or 'misc'}] {match['message']}"] += 1
    return found


def run_mypy() -> tuple[int, str]:
    _link_tree()
    args = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary",
            "--no-pretty", "--show-column-numbers", "--hide-error-context"]
    for package in PACKAGES.values():
        args += ["-p", package]
    env = {**os.environ, "MYPYPATH": str(LINKS)}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    return done.returncode, done.stdout + done.stderr


def read_baseline() -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    if BASELINE.exists():
        for line in BASELINE.read_text().splitlines():
            if line and not line.startswith("#"):
                count, _, entry = line.partition(" ")
                counts[entry] = int(count)
    return counts


def write_baseline(found: collections.Counter[str]) -> None:
    header = f"# mypy errors known today: '<count> <path>: [code] message'. Regenerate with: {UPDATE_HINT}\n"
    BASELINE.write_text(header + "".join(f"{n} {entry}\n" for entry, n in sorted(found.items())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help=f"rewrite {BASELINE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    returncode, output = run_mypy()
    if returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash); no error list to trust
        print(output, file=sys.stderr)
        return 2
    found = normalise(output)
    if returncode == 1 and not found:
        print(f"mypy failed but no error line was understood:\n{output}", file=sys.stderr)
        return 2
    if args.update:
        write_baseline(found)
        print(f"{BASELINE.relative_to(ROOT)}: {sum(found.values())} known error(s)")
        return 0
    known = read_baseline()
    new, fixed = found - known, known - found
    if new:
        print("New mypy errors (fix them; the baseline only shrinks):", file=sys.stderr)
        for entry in sorted(new):
            print(f"  {entry}", file=sys.stderr)
        print("\nFull mypy output:\n" + output, file=sys.stderr)
        return 1
    if fixed:
        print(f"These baseline errors are gone - well done; shrink the baseline with: {UPDATE_HINT}", file=sys.stderr)
        for entry in sorted(fixed):
            print(f"  {entry}", file=sys.stderr)
        return 1
    print(f"mypy: {sum(found.values())} known error(s), none new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
