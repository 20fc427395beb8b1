"""`python -m dflash_cli` = the `dflash` command."""

from dflash_cli.cli.app import main

if __name__ == "__main__":  # importing the module (a spawned process, a tool) must not run the CLI
    main()
