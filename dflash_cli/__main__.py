"""`python -m dflash_cli` = the `dflash` command."""

from dflash_cli.cli.app import main

if __name__ == "__main__":  # the export's second process (spawn) imports this module too
    main()
