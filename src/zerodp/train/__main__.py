"""``python -m zerodp.train``: the per-rank entry under torchrun (see ``zerodp.train``)."""

import sys

from zerodp.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
