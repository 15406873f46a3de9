"""``uv run apps/tau [train|eval] [flags]`` from the repository root (see apps/tau/README.md)."""

import sys

from turnrl_app_tau.main import main

if __name__ == "__main__":
    sys.exit(main())
