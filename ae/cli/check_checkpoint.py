"""`python -m ae.cli.check_checkpoint CKPT`: exit 2 with the one refusal message when the safe
loader would refuse CKPT (`ae.training.position.checkpoint_read`), 0 otherwise. Reads the
pickle without running it. ae-encode's launcher, which never imports torch, asks this before it
starts ranks.
"""

from __future__ import annotations

import sys

from ae.training.position.checkpoint_read import UntrustedCheckpoint, unsafe_globals


def main(argv: list[str]) -> int:
    (path,) = argv
    if names := unsafe_globals(path):
        sys.stderr.write(UntrustedCheckpoint(path, names).render() + "\n")
        return UntrustedCheckpoint.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
