"""``uv run apps/agent [train|eval] [flags]`` from the repository root (see apps/agent/README.md)."""

import sys

from turnrl_app_agent.main import main

if __name__ == "__main__":
    sys.exit(main())
