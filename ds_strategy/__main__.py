"""``python -m ds_strategy``: the ``ds-strategy`` command, for an environment where the script
is not on ``PATH`` (``python -m ds_strategy env``, ``python -m ds_strategy --version``)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
