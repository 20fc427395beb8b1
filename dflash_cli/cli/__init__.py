"""The `dflash` command line: typer commands that parse options and call the library."""
