"""The ``graft`` command tree. Each command group lives in its own module of this package; this one wires them up
and turns every user error into one line on stderr with exit code 2 (``GRAFT_DEBUG=1`` adds the traceback, same
code).

The command modules import their work inside the command functions, the one place in graft where imports wait:
``graft --help``, a usage error and the light commands then start without loading torch or transformers (about a
second each)."""

from __future__ import annotations

import gc
import os
import signal
import sys
import traceback

import typer

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover - older typer on plain click
    from click import exceptions as cx

from graft_cli.cli.bench import bench
from graft_cli.cli.generate import generate
from graft_cli.cli.heads import heads_app
from graft_cli.cli.index import index_app
from graft_cli.cli.models import models_app
from graft_cli.cli.plugins import plugins_app
from graft_cli.cli.responses import responses_app
from graft_cli.cli.serve import serve
from graft_cli.core import GraftError
from graft_cli.core.version import __version__
from graft_cli.core.memory import reuse_freed_memory
from graft_cli.core.threads import wait_briefly

app = typer.Typer(
    name="graft",
    help="Lossless speculative decoding: draft less, retrieve more.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(generate)
app.command()(bench)
app.command()(serve)
app.add_typer(index_app, name="index", help="Build and manage on-disk token datastores.")
app.add_typer(heads_app, name="heads", help="EAGLE-3 draft heads: train, list, evaluate, ship.")
app.add_typer(models_app, name="models", help="The model catalog: list, pull, inspect and remove models.")
app.add_typer(plugins_app, name="plugins", help="Retriever plugins discovered through entry points.")
app.add_typer(responses_app, name="responses", help="The response cache kept on disk: inspect it or clear it.")


def fail(message: str, code: int = 2) -> None:
    print(f"graft: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM ends graft the way Ctrl-C does: cleanup code runs (temporaries removed, child processes stopped,
    tokenizer workers shut down), then exit 143."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    print("graft: error: terminated", file=sys.stderr, flush=True)
    raise SystemExit(143)


def _sweep() -> None:
    """Remove what graft processes killed outright (SIGKILL, a power cut) left behind: pull work dirs under
    GRAFT_HOME/tmp, store build temporaries and locks under GRAFT_HOME/datastores, half-written files of GRAFT_HOME
    itself (the GGUF index), of its profiles and of its kernels. Those of live processes stay."""
    from datastores.atomic import clean_stale_tmp, sweep
    from graft_cli.catalog.home import clean_stale_tmp as clean_pull_dirs
    from graft_cli.catalog.home import graft_home

    try:
        clean_pull_dirs()
        sweep(graft_home() / "datastores")
        for directory in (graft_home(), graft_home() / "profiles", graft_home() / "kernels"):
            clean_stale_tmp(directory)
    except OSError:
        pass  # a GRAFT_HOME we cannot read is the command's own problem to report


def _process_settings() -> None:
    """What a graft command sets for its own process, and a program that imports graft does not get: transformers'
    own warnings stay off stderr (unless the user set TRANSFORMERS_VERBOSITY), freed memory is kept for the next
    step (graft_cli/core/memory.py) and torch's threads spin only briefly while they wait
    (graft_cli/core/threads.py). The network is reached only to fetch a model or head the user named."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    reuse_freed_memory()
    wait_briefly()


def _trace(debug: bool) -> None:
    """With ``GRAFT_DEBUG=1`` the traceback of the error being handled goes to stderr before its one line; the exit
    code stays the error's own (2), so a script that tests it behaves the same while someone debugs."""
    if debug:
        traceback.print_exc()


def _version(show: bool) -> None:
    if show:
        print(f"graft {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_version,
                                          help="Print graft's version and exit.")) -> None:
    """Lossless speculative decoding: draft less, retrieve more."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    debug = os.environ.get("GRAFT_DEBUG") == "1"
    _process_settings()
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        _sweep()
        _run(argv, debug)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if argv is None:  # the command's own process, about to exit (tests call main with their arguments)
            gc.freeze()  # exit then skips a last collection over torch's objects (0.4 s of CPU on a 2-core EPYC)


def _run(argv: list[str] | None, debug: bool) -> None:
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Exit as e:
        raise SystemExit(e.exit_code)
    except typer.Abort:
        fail("interrupted", 130)
    except cx.ClickException as e:  # usage errors: a wrong flag, a bad value, a missing argument
        if type(e).__name__ == "NoArgsIsHelpError":  # `graft` or `graft index` alone: the help was the answer
            text = e.format_message()
            if text.strip():
                print(text)
            raise SystemExit(0)
        _trace(debug)
        fail(e.format_message().replace("\n", " "))
    except GraftError as e:
        _trace(debug)
        fail(str(e))
    except BrokenPipeError:  # e.g. `graft generate ... | head`
        sys.stderr.close()
        raise SystemExit(0)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    if code == 130:  # typer turns Ctrl-C into this return value when it does not exit by itself
        fail("interrupted", 130)
    if isinstance(code, int) and code:
        raise SystemExit(code)
