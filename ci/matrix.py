"""Print the CI job matrix as JSON, derived from the nox sessions (defined once, in noxfile.py).

python ci/matrix.py --tags tests wheel lint    # -> {"session": ["tests-3.11(package='...')", ...]}
"""

from __future__ import annotations

import argparse
import json
import subprocess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tags", nargs="+", required=True, help="nox session tags to include")
    args = parser.parse_args()
    listing = subprocess.run(
        ["nox", "--list", "--json"], check=True, capture_output=True, text=True
    ).stdout
    sessions = [s["session"] for s in json.loads(listing) if set(s["tags"]) & set(args.tags)]
    print(json.dumps({"session": sessions}))


if __name__ == "__main__":
    main()
