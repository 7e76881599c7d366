"""`python -m ctxbuild_devstack up|down|status|logs` — the Makefile's stack commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .stack import INFRA, SERVICES, Stack, StackError

app = typer.Typer(add_completion=False, help="Run the ctxbuild local stack (no Docker).")
console = Console()
DirOpt = Annotated[Path, typer.Option("--dir", help="stack state directory")]


READY_WAIT_S = 30.0  # a live service reconnecting to a restarted NATS / Postgres gets this long before a restart


@app.command()
def up(dir: DirOpt = Path(".stack"), infra_only: bool = typer.Option(False, help="only NATS, Postgres, S3"),
       ready_wait: float = typer.Option(READY_WAIT_S, help="seconds a live service may take to become ready "
                                                           "before it is restarted")) -> None:
    """Start NATS, PostgreSQL, SeaweedFS and the six services (idempotent). A dead component comes back on its own
    port; a live service that does not become ready is restarted; "stack up" only when every one is ready."""
    st = Stack.load(dir)
    try:
        with console.status("starting infrastructure…"):
            st.start_infra()
        if not infra_only:
            for name in SERVICES:
                with console.status(f"starting {name}…"):
                    if st.alive(name) and not st.wait_ready(name, ready_wait):
                        console.print(f"[yellow]{name} alive but not ready after {ready_wait:.0f}s: "
                                      "restarting it[/yellow]")
                        st.stop(name, timeout=10)
                    st.start_service(name)
            if st.env.get("CTX_ADMIN_API_KEY"):
                st.ensure_api_key()  # already running: the key is still there (or issued again)
    except StackError as exc:
        console.print(f"[red]stack failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    names = [*INFRA] if infra_only else [*INFRA, *SERVICES]
    not_ready = [n for n in names if not st.ready(n)]
    if not_ready:
        console.print(f"[red]stack not ready:[/red] {', '.join(not_ready)} (make status, make logs NAME=…)")
        raise typer.Exit(1)
    console.print(f"[green]stack up[/green]; environment in {st.env_file}")
    if not infra_only:
        if st.api_key_file.is_file():
            console.print(f"API key (tenant local) in {st.api_key_file}: the CLI and the demo use it")
        else:
            console.print("[yellow]no API key:[/yellow] this stack's edge predates authentication; "
                          "run `make down && make up`")


@app.command()
def down(dir: DirOpt = Path(".stack")) -> None:
    """Stop services (SIGTERM, drain) then infrastructure."""
    Stack.load(dir).down()
    console.print("stack down")


@app.command()
def status(dir: DirOpt = Path(".stack")) -> None:
    """Show each component, whether it is alive and ready; exit 1 unless all nine are alive and ready."""
    st = Stack.load(dir)
    t = Table("component", "pid", "alive", "ready", "log")
    rows = st.status()
    for name in [*INFRA, *SERVICES]:
        r = rows.get(name)
        if r is None:
            t.add_row(name, "-", "no", "no", "-")
        else:
            t.add_row(name, str(r["pid"]), "yes" if r["alive"] else "no", "yes" if r["ready"] else "no", r["log"])
    console.print(t)
    if not all(rows.get(n, {}).get("ready") for n in [*INFRA, *SERVICES]):
        raise typer.Exit(1)


@app.command()
def logs(name: Annotated[str | None, typer.Argument()] = None, dir: DirOpt = Path(".stack"),
         lines: int = 40) -> None:
    """Print the last lines of one component's log, or of all."""
    st = Stack.load(dir)
    names = [name] if name else [*INFRA, *SERVICES]
    for n in names:
        p = st.logs / f"{n}.log"
        if p.exists():
            console.rule(n)
            console.print("\n".join(p.read_text(errors="replace").splitlines()[-lines:]), markup=False,
                          highlight=False)


@app.command()
def env(dir: DirOpt = Path(".stack")) -> None:
    """Print the environment the services read (shell `export` lines)."""
    for k, v in sorted(Stack.load(dir).env.items()):
        print(f"export {k}={v}")


if __name__ == "__main__":
    app()
