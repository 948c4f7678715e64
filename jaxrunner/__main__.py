"""``python -m jaxrunner``: the command line."""

from jaxrunner.cli import main

main()
