"""The process torchrun starts for each rank of ae-encode: one rank's flow, `ae.rank.encode`."""

from __future__ import annotations

import sys

from ae.rank.encode import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
