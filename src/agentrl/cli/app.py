"""The typer apps the commands register on, and the root options (--verbose)."""

import logging
import warnings
from typing import Annotated

import typer
from rich.logging import RichHandler

from agentrl.cli.display import err
from agentrl.procmem import return_freed_memory

app = typer.Typer(add_completion=False, no_args_is_help=True, help="GRPO for LLM agents on ALFWorld, with selective rollouts.")
model_app = typer.Typer(no_args_is_help=True, help="The default model (SmolLM2-135M-Instruct, from a PyPI wheel).")
data_app = typer.Typer(no_args_is_help=True, help="ALFWorld game files.")
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    return_freed_memory()  # freed activations go back to the system, not into a fragmented heap (procmem.py)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False, show_time=False)],
    )
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # deprecations, not ours
    for noisy in ("transformers", "textworld", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
