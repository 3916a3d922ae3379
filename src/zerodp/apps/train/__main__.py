"""``python -m zerodp.apps.train``: the per-rank entry under torchrun (see the package)."""

import sys

from zerodp.apps.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
