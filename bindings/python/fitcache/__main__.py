"""The ``fitcache`` command: runs the Go program installed with the package."""

import os
import sys

from ._native import server_binary


def main() -> None:
    binary = server_binary()
    if not os.access(binary, os.X_OK):
        sys.exit(f"fitcache: the fitcache program is missing at {binary}; reinstall the package")
    os.execv(binary, [binary] + sys.argv[1:])


if __name__ == "__main__":
    main()
