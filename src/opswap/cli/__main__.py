"""`python -m opswap.cli`: the `opswap` command."""

from opswap.cli import main

main()
