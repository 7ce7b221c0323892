"""`mcorekit export`: not built yet."""

from __future__ import annotations

import argparse

from mcorekit.errors import NotBuiltError

NOT_BUILT = True


def main(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mcorekit export", description=__doc__)
    parser.parse_args(argv)
    raise NotBuiltError("`mcorekit export` is not built yet: it is planned (see the README's status table) and does nothing today")
