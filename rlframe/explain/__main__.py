"""`python -m rlframe.explain`, as `rlframe explain`."""

import sys

from rlframe.explain.cli import main

if __name__ == "__main__":  # importing the package's modules one by one (the packaging test) must not run it
    sys.exit(main())
