"""The running environment against a lock file. ``--require`` (scripts/setup.sh): every pin must
hold, else exit 1 naming each; packages outside the lock are named, not removed (someone put
them there). Without it (scripts/test_newest.sh): one line saying which packages differ."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata


def _name(text: str) -> str:
    return text.strip().lower().replace("_", "-")


def read_lock(path: str) -> dict[str, str]:
    pins = (line.split("==") for line in open(path) if "==" in line and not line.startswith("#"))
    return {_name(name): version.strip() for name, version in pins}


def installed() -> dict[str, str]:
    """Versions without a local label: torch 2.13.0+cpu holds the pin torch==2.13.0."""
    return {_name(d.metadata["Name"]): d.version.split("+")[0] for d in metadata.distributions()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("lock")
    parser.add_argument("--require", action="store_true", help="exit 1 unless every pin holds")
    args = parser.parse_args()
    want, have = read_lock(args.lock), installed()
    have.pop("sparse-ft", None)
    if args.require:
        wrong = [f"{n}=={v} (installed: {have.get(n, 'none')})" for n, v in sorted(want.items()) if have.get(n) != v]
        if wrong:
            print(f"installed versions differ from {args.lock}: {', '.join(wrong)}", file=sys.stderr)
            return 1
        extra = sorted(set(have) - set(want))
        if extra:
            print(f"the environment also holds packages outside {args.lock}: {', '.join(extra)}", file=sys.stderr)
        return 0
    changed = [f"{n} {have[n]} (lock {want.get(n, 'none')})" for n in sorted(have) if have[n] != want.get(n)]
    print(f"differs from {args.lock}: {', '.join(changed) if changed else 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
