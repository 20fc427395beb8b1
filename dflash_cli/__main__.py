"""`python -m dflash_cli` = the `dflash` command."""

from dflash_cli.cli.app import main

main()
