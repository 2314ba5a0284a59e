"""The `reshard` command line: plan, write, verify, files, merge, demo, env (in the order `--help` lists them).

Each command parses its flags, calls one function of the entry layer (`reshard.api`) and prints the result it returns
(`summary()`, or `to_json()` with `--json`). Errors reach the user through one boundary (`ReshardGroup.invoke`): a bad
call, or flags that cannot work with the input (`UsageError`: a mesh the model does not fit, a quantized source without
--dequantize, a URL as OUT) exits 2 with the usage line, any other `ReshardError` becomes its message and exit 1,
`--debug` shows the traceback; Ctrl-C exits 130 and SIGTERM 143 (128 + the signal), after cleaning up.
"""

from __future__ import annotations

import functools
import re
import signal
import sys

import click

from .cli_help import (CLI_HELP, DEMO_HELP, ENV_HELP, FILES_HELP, MERGE_HELP, PLAN_HELP, VERIFY_HELP,
                       WRITE_HELP)
from .errors import ReshardError, UsageError
from .params import Count, RanksType, SizeType
from .plan import LayoutMode, MergeLayout


def _interrupting_signal(interrupt: KeyboardInterrupt) -> signal.Signals:
    # SIGTERM handlers (ours, and the one `write` installs while it writes) raise KeyboardInterrupt("signal N");
    # Ctrl-C raises it bare.
    match = re.fullmatch(r"signal (\d+)", str(interrupt))
    if match and int(match[1]) in signal.valid_signals():
        return signal.Signals(int(match[1]))
    return signal.SIGINT


class ReshardGroup(click.Group):
    """The single error boundary: flags that cannot work exit 2 like a bad call, other domain errors print their
    message (exit 1), unless --debug; interruptions exit 128 + the signal. `--help` lists the commands in the order a
    user runs them."""

    FLOW = ("plan", "write", "verify", "files", "merge", "demo", "env")

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        return [n for n in self.FLOW if n in names] + [n for n in names if n not in self.FLOW]

    def invoke(self, ctx: click.Context):
        try:
            from .signals import sigterm_as_interrupt

            with sigterm_as_interrupt():
                return super().invoke(ctx)
        except UsageError as e:
            if ctx.params.get("debug"):
                raise
            command = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            usage_ctx = click.Context(command, info_name=ctx.invoked_subcommand, parent=ctx) if command else ctx
            raise click.UsageError(str(e), ctx=usage_ctx) from e
        except ReshardError as e:
            if ctx.params.get("debug"):
                raise
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt as e:
            signum = _interrupting_signal(e)
            click.echo(f"interrupted ({signum.name}); {_left_behind(e)}", err=True)
            sys.exit(128 + signum)


def _left_behind(interrupt: KeyboardInterrupt) -> str:
    """What an interrupted command left on disk: a write or merge may leave part of its temporary folder, when its
    removal ran out of time (`reshard.write._staged._remove_within`), and says so on the interrupt; any other command
    writes nothing."""
    staged = sys.modules.get("reshard.write._staged")  # not imported: no write ran, so nothing was left
    return staged.left_behind_text(interrupt) if staged is not None else "nothing partial was left behind."


def _mesh_options(func):
    """The mesh flags shared by every command, mirroring transformers' DistributedConfig (tensor and pipeline
    parallelism stay hidden until reshard writes layouts for them)."""

    @click.option("--fsdp", type=Count(min=1), required=True,
                  help="fsdp_size: ranks sharding every parameter; with EP, each EP group's experts are sharded over "
                       "efsdp = fsdp/ep ranks.")
    @click.option("--ep", type=Count(min=1), default=1, show_default=True,
                  help="ep_size: expert-parallel ranks; must divide fsdp and the number of experts.")
    @click.option("--dp-replicate", type=Count(min=1), default=1, show_default=True,
                  help="dp_replicate_size: HSDP replicas (whole copies of the fsdp-sharded model); they share files.")
    @click.option("--tp", type=Count(min=1), default=1, hidden=True)
    @click.option("--pp", type=Count(min=1), default=1, hidden=True)
    @functools.wraps(func)
    def wrapper(*args, fsdp, ep, dp_replicate, tp, pp, **kwargs):
        from .plan import MeshSpec

        try:
            mesh = MeshSpec(fsdp=fsdp, ep=ep, dp_replicate=dp_replicate, tp=tp, pp=pp)
        except UsageError as e:
            raise click.UsageError(str(e)) from e
        return func(*args, mesh=mesh, **kwargs)

    return wrapper


def _stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def _show(result, as_json: bool) -> None:
    click.echo(result.to_json() if as_json else result.summary())


_layout_option = click.option(
    "--layout", "mode", type=click.Choice([m.value for m in LayoutMode]), default=LayoutMode.BALANCED.value,
    show_default=True,
    help="balanced: split uneven expert tensors on a dim that divides evenly; stock: as transformers does.")
_revision_option = click.option("--revision", metavar="REV", default=None,
                               help="Hub branch, tag or commit (Hub sources only).")
_stream_option = click.option("--stream", is_flag=True,
                             help="Read a Hub SRC in byte ranges instead of downloading it first (cached files are "
                                  "read from the cache).")
_json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as a JSON document instead.")
_quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress bar.")


@click.group(help=CLI_HELP, cls=ReshardGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="reshard")
def cli(debug):
    """The command group: the help text is `CLI_HELP`."""



@cli.command(help=PLAN_HELP, short_help="Plan SRC on the mesh: stock vs reshard, from headers only.")
@click.argument("src")
@_mesh_options
@_layout_option
@_revision_option
@_stream_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as a JSON document (reshard_plan_version 1).")
def plan(src, mesh, mode, revision, stream, as_json):
    from .api import plan_checkpoint

    _show(plan_checkpoint(src, mesh, mode=mode, revision=revision, stream=stream), as_json)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="reshard")


@cli.command(help=WRITE_HELP, short_help="Write SRC into OUT as per-rank files for the mesh.")
@click.argument("src")
@click.argument("out")
@_mesh_options
@_layout_option
@_revision_option
@_stream_option
@click.option("--max-shard-size", type=SizeType(), default=None,
              help="Split each rank's data into files of at most this size (e.g. 5GB). Default: one file per rank.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (swapped in only once complete).")
@click.option("--workers", type=Count(min=1), default=None,
              help="Processes writing on this machine (same output). Default: up to 4, by cores and size; every "
                   "core with --dequantize.")
@click.option("--distributed/--no-distributed", default=None,
              help="Write as one rank of a torchrun job, into a shared OUT. Default: on when RANK, LOCAL_RANK "
                   "and WORLD_SIZE > 1 are set.")
@click.option("--node-local", is_flag=True,
              help="In a multi-node torchrun: each node writes into OUT on its own disk just the files its "
                   "processes' ranks load.")
@click.option("--ranks", type=RanksType(), default=None,
              help="Write one node's copy in this process: the files these ranks load (0-7, or 0,8,16-23).")
@click.option("--dequantize", type=click.Choice(["bf16"]), default=None,
              help="Write a quantized SRC (block-scaled FP8, MXFP4) as bf16 rank files in one pass; required for "
                   "one.")
@click.option("--drop-unloaded", is_flag=True,
              help="Leave out the tensors the model does not load (MTP layers). Default: kept in files no rank "
                   "loads, for merge.")
@_quiet_option
@_json_option
def write(src, out, mesh, mode, revision, stream, max_shard_size, overwrite, workers, distributed, node_local, ranks,
          dequantize, drop_unloaded, quiet, as_json):
    from .api import write_checkpoint

    result = write_checkpoint(src, out, mesh, mode=mode, revision=revision, stream=stream, overwrite=overwrite,
                              max_shard_size=max_shard_size, progress=False if quiet else None, workers=workers,
                              distributed=distributed, dequantize=dequantize, drop_unloaded=drop_unloaded,
                              ranks=ranks, node_local=node_local)
    if result is not None:  # None: another rank of a distributed write; rank 0 prints the summary
        _show(result, as_json)


@cli.command(name="verify", help=VERIFY_HELP,
             short_help="Check OUT's files and coverage; with --against SRC, every byte.")
@click.argument("out")
@click.option("--against", "against", metavar="SRC", default=None,
              help="The source checkpoint: compare every byte with it.")
@_revision_option
@click.option("--no-checksums", is_flag=True, help="Skip recomputing each file's CRC-32 (faster, less thorough).")
@click.option("--ranks", type=RanksType(), default=None,
              help="Check only the files these ranks load (a node's copy staged by hand): 0-7, or 0,8,16-23.")
@_quiet_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as a JSON document (also when it fails).")
def _verify_command(out, against, revision, no_checksums, ranks, quiet, as_json):
    from .api import verify_folder

    result = verify_folder(out, against=against, revision=revision, checksums=not no_checksums,
                           progress=False if quiet else None, ranks=ranks)
    if as_json:
        click.echo(result.to_json())
    if not result.ok:
        for line in result.problems:
            click.echo(f"FAIL {line}", err=True)
        raise click.ClickException(result.failure())
    if not as_json:
        click.echo(result.summary())


@cli.command(help=FILES_HELP, name="files", short_help="List the files RANKS need to load OUT (node-local copies).")
@click.argument("out")
@click.option("--ranks", type=RanksType(), required=True,
              help="Global ranks, counted from 0: 0-7 (one node of 8 GPUs) or 0,8,16-23.")
@_json_option
def _files_command(out, ranks, as_json):
    from .api import list_files

    result = list_files(out, ranks)
    if not as_json:
        click.echo(result.numbering(), err=True)
    _show(result, as_json)


@cli.command(name="merge", help=MERGE_HELP,
             short_help="Merge distributed SRC back into DEST, a standard HF checkpoint.")
@click.argument("src")
@click.argument("dest")
@click.option("--max-shard-size", type=SizeType(), default="5GB", show_default=True,
              help="Files of at most this size (5GB, 500MiB, bytes), as save_pretrained writes them.")
@click.option("--layout", "layout", type=click.Choice([m.value for m in MergeLayout]),
              default=MergeLayout.ORIGINAL.value, show_default=True,
              help="; ".join(f"{m.value}: {m.describe()}" for m in MergeLayout) + ".")
@click.option("--overwrite", is_flag=True,
              help="Replace DEST if it exists (swapped in once complete): an empty folder, a merge or reshard "
                   "output only.")
@click.option("--extras-from", "extras_from", metavar="FOLDER", default=None,
              help="For a saved SRC: the folder training started from, whose unloaded tensors (MTP layers) DEST "
                   "gets back.")
@click.option("--workers", type=Count(min=1), default=None,
              help="Processes writing DEST's files on this machine (same output). Default: up to 4, by cores and "
                   "size.")
@click.option("--distributed/--no-distributed", default=None,
              help="Merge as one rank of a torchrun job, into a shared DEST. Default: on when RANK, LOCAL_RANK "
                   "and WORLD_SIZE > 1 are set.")
@click.option("--node-local", is_flag=True,
              help="In a multi-node torchrun: SRC's rank files lie on each node's own disk; node 0's ranks read "
                   "them over the process group and write DEST.")
@_quiet_option
@_json_option
def _merge_command(src, dest, max_shard_size, layout, overwrite, extras_from, workers, distributed, node_local, quiet,
                  as_json):
    from .api import merge_checkpoint

    result = merge_checkpoint(src, dest, max_shard_size=max_shard_size, layout=layout, overwrite=overwrite,
                              progress=False if quiet else None, extras_from=extras_from, workers=workers,
                              distributed=distributed, node_local=node_local)
    if result is not None:  # None: another rank of a distributed merge; rank 0 prints the summary
        _show(result, as_json)


@cli.command(help=DEMO_HELP, short_help="Run the whole job on a tiny generated model (nothing downloaded).")
@click.option("--ranks", type=Count(min=2, max=16), default=4, show_default=True,
              help="CPU processes for the multi-rank load (the mesh is --fsdp RANKS).")
@click.option("--keep", type=click.Path(file_okay=False), metavar="DIR", default=None,
              help="Keep the generated checkpoint, the output and the rank reports in this folder.")
def demo(ranks, keep):
    from .demo import run_demo

    click.echo(run_demo(ranks=ranks, keep=keep, echo=click.echo).summary())


@cli.command(name="env", help=ENV_HELP,
             short_help="Versions, loader-patch hooks, launcher variables: for a bug report.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as a JSON document (reshard_env_version 1).")
def _env_command(as_json):
    from .api import environment, environment_lines

    if as_json:
        _show(environment(), as_json)
        return
    note = "importing torch and transformers to check the build and the loader-patch hooks (about 10 s) ..."
    shown = []

    def waiting() -> None:  # a terminal is told what the pause is; a pipe (a pasted report) gets the lines alone
        if _stderr_is_terminal():
            click.echo(note, err=True, nl=False)
            shown.append(True)

    for line in environment_lines(waiting):  # the versions at once; torch's build and the hooks take seconds
        if shown:
            click.echo("\r" + " " * len(note) + "\r", err=True, nl=False)
            shown.clear()
        click.echo(line)
