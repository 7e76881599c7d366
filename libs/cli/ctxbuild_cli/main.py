import typer

app = typer.Typer(help="ctxbuild: run agent turns through a running ctxbuild stack", no_args_is_help=True)
