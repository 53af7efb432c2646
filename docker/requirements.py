"""Print the install_requires of setup.cfg as a requirements file (the image installs them before locomm).

Usage: python3 requirements.py setup.cfg > requirements.txt
"""

import configparser
import sys


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: requirements.py SETUP_CFG")
    cfg = configparser.ConfigParser()
    if not cfg.read(sys.argv[1]):
        sys.exit(f"requirements.py: cannot read {sys.argv[1]}")
    try:
        lines = cfg["options"]["install_requires"].splitlines()
    except KeyError:
        sys.exit(f"requirements.py: {sys.argv[1]} has no [options] install_requires")
    reqs = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    print("\n".join(reqs))


if __name__ == "__main__":
    main()
