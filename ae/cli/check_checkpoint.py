"""`python -m ae.cli.check_checkpoint CKPT`: exit 2 with the one refusal message when CKPT is no
checkpoint of an ae run that the safe loader reads (damaged, needing code to unpickle, not ae's:
`ae.training.position.checkpoint_read.read_ae_checkpoint`, which each rank calls too), 0
otherwise. Maps the tensors rather than reading them. ae-encode's launcher, which never imports
torch, asks this before it starts ranks.
"""

from __future__ import annotations

import sys

from ae.errors import UserError
from ae.training.position.checkpoint_read import read_ae_checkpoint


def main(argv: list[str]) -> int:
    (path,) = argv
    try:
        read_ae_checkpoint(path, mmap=True)
    except UserError as e:
        sys.stderr.write(e.render() + "\n")
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
