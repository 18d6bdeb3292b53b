"""agentrl command line. Thin: parse flags, load the config, call one function, print.

app.py holds the typer apps, options.py the options the commands share (each knows its config
field), display.py what they print; run.py and tools.py the commands themselves."""

import sys

import click
import typer

import agentrl
from agentrl.cli import run, tools  # noqa: F401  (registers the commands on app)
from agentrl.cli.app import app
from agentrl.cli.display import err
from agentrl.cli.options import REMOVED_FLAGS
from agentrl.errors import UserError
from agentrl.procmem import exec_allocator

__all__ = ["app", "console", "main"]


def console() -> None:
    """The `agentrl` program (and `python -m agentrl.cli`): the allocator first (procmem.py:
    `agentrl sft` starts again under mimalloc where it is installed), then the command."""
    if agentrl.OMP_DYNAMIC_OVERRIDDEN is not None:  # turned off at import (agentrl/__init__.py): say so, once
        print(f"warning: OMP_DYNAMIC={agentrl.OMP_DYNAMIC_OVERRIDDEN} ignored: dynamic OpenMP teams leave parts of torch's "
              "bf16 CPU matmuls unwritten (NaN); agentrl runs with OMP_DYNAMIC=false", file=sys.stderr)
    exec_allocator([sys.executable, "-m", "agentrl.cli"])
    main()


def main() -> None:
    try:
        app(standalone_mode=False, prog_name="agentrl")
    except UserError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:  # usage errors: click's, or those of the copy of click newer typers carry
        if isinstance(e, (typer.Exit, click.exceptions.Exit)):
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.ClickException) or type(e).__module__.startswith("typer."):
            if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # one line, as for every bad input
                removed = REMOVED_FLAGS.get(getattr(getattr(e, "ctx", None), "info_name", None), {})
                flag = getattr(e, "option_name", None)
                message = f"{flag} was removed: use {removed[flag]}" if flag in removed else f"{e.format_message()} (see --help)"
                err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
                sys.exit(e.exit_code)
        raise
