"""`python -m ae.cli.check_checkpoint CKPT`: exit 2 with the one refusal message when CKPT is no
checkpoint of an ae run that the safe loader reads (damaged, needing code to unpickle, not ae's:
`ae.training.position.checkpoint_read.read_ae_checkpoint`, which each rank calls too), or when
its model is a class of the user's that cannot be found from the working directory; 0
otherwise. Maps the tensors rather than reading them. ae-encode's launcher, which never imports
torch, asks this before it starts ranks.
"""

from __future__ import annotations

import sys

from ae.config import BUILTIN_MODELS, Config
from ae.config.model_path import locate_class
from ae.errors import UserError
from ae.training.position.checkpoint_read import read_ae_checkpoint


def own_class_problem(path: str, ckpt: dict) -> str | None:
    """Where the checkpoint's model is a class of the user's: the problem of finding it from
    here (ae-encode run from another folder than its training), or None. Nothing is imported:
    the ranks would have failed to import it each, after starting."""
    model = Config.from_flat(ckpt["ae_config"]).model.model
    if model in BUILTIN_MODELS or (problem := locate_class(model)) is None:
        return None
    return (
        f"{path}: its model is your own class {model}, which cannot be found from here: "
        f"{problem.removeprefix('model: ')}; run from the folder its training ran in, or put "
        "the folder holding the module on PYTHONPATH"
    )


def main(argv: list[str]) -> int:
    (path,) = argv
    try:
        ckpt = read_ae_checkpoint(path, mmap=True)
    except UserError as e:
        sys.stderr.write(e.render() + "\n")
        return e.exit_code
    if (problem := own_class_problem(path, ckpt)) is not None:
        sys.stderr.write(problem + "\n")
        return UserError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
