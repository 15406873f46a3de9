"""`uv run apps/retool` from the repository root runs this file (the app's entry point)."""

import sys
from pathlib import Path

try:
    from turnrl_app_retool.main import main
except ImportError:  # run as a plain folder without the workspace installed: use the sources
    sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))
    from turnrl_app_retool.main import main

if __name__ == "__main__":
    sys.exit(main())
