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

from .errors import ReshardError, UsageError
from .params import Count, RanksType, SizeType
from .plan.layout import MergeLayout
from .plan.placement import LayoutMode


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
    removal ran out of time (`reshard.write.staged.remove_within`), and says so on the interrupt; any other command
    writes nothing."""
    staged = sys.modules.get("reshard.write.staged")  # not imported: no write ran, so nothing was left
    return staged.left_behind_text(interrupt) if staged is not None else "nothing partial was left behind."


def mesh_options(func):
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
        from .plan.mesh import MeshSpec

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


layout_option = click.option(
    "--layout", "mode", type=click.Choice([m.value for m in LayoutMode]), default=LayoutMode.BALANCED.value,
    show_default=True,
    help="balanced: split uneven expert tensors on a dim that divides evenly; stock: as transformers does.")
revision_option = click.option("--revision", metavar="REV", default=None,
                               help="Hub branch, tag or commit (Hub sources only).")
stream_option = click.option("--stream", is_flag=True,
                             help="Read a Hub SRC in byte ranges instead of downloading it first (cached files are "
                                  "read from the cache).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as a JSON document instead.")
quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress bar.")


@click.group(cls=ReshardGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="reshard")
def cli(debug):
    """Plan, write, verify, merge per-rank MoE checkpoints for FSDP2 x EP meshes.

    In Python, reshard.from_pretrained(OUT) on every rank patches transformers' loader to load them: no empty
    rank, no hang, each rank reading only its own bytes.

    \b
    Typical flow:
      reshard demo                             # the whole job on a tiny generated model
      reshard plan   SRC --fsdp 64 --ep 8      # what would happen, from headers only
      reshard write  SRC OUT --fsdp 64 --ep 8  # per-rank files + reshard.json
      reshard verify OUT --against SRC         # coverage and bit-identity
      torchrun ... train.py                    # reshard.from_pretrained(OUT), train, save
      reshard merge  SAVED HF_OUT              # back to a standard HF checkpoint

    SRC is a checkpoint folder or .safetensors file, a Hugging Face cache snapshot folder, a Hub repo id
    (org/name), an s3://bucket/prefix URL (pip install -e '.[s3]'; endpoint and credentials from the AWS
    environment), a reshard folder or a save_pretrained(..., distributed_checkpoint=True) folder.
    """


@cli.command(short_help="Plan SRC on the mesh: stock vs reshard, from headers only.")
@click.argument("src")
@mesh_options
@layout_option
@revision_option
@stream_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as a JSON document (reshard_plan_version 1).")
def plan(src, mesh, mode, revision, stream, as_json):
    """Show how SRC would be sharded on the mesh, stock vs reshard, from headers only.

    Reads config.json, the index and the safetensors headers (never tensor data), finds the routed experts with
    transformers' conversion mapping, simulates transformers + FSDP2 for every tensor and rank, flags every empty
    local, and shows the layout `reshard write` would produce. SRC is anything `write` takes.

    \b
    Example:
      reshard plan zai-org/GLM-4.6 --fsdp 64 --ep 8
      reshard plan s3://models/GLM-4.6 --fsdp 64 --ep 8
    """
    from .api import plan_checkpoint

    _show(plan_checkpoint(src, mesh, mode=mode, revision=revision, stream=stream), as_json)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="reshard")


@cli.command(short_help="Write SRC into OUT as per-rank files for the mesh.")
@click.argument("src")
@click.argument("out")
@mesh_options
@layout_option
@revision_option
@stream_option
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
@quiet_option
@json_option
def write(src, out, mesh, mode, revision, stream, max_shard_size, overwrite, workers, distributed, node_local, ranks,
          dequantize, drop_unloaded, quiet, as_json):
    """Write SRC as per-rank shard files for the mesh into OUT, plus reshard.json.

    Every rank gets its own file (replicas share them): a non-empty slice of every tensor, or an explicit empty
    marker where no even split exists. Bytes are copied exactly (no dtype change); fused experts are composed
    from per-expert keys slice by slice. OUT is a folder on a local or shared file system; it appears only when
    complete, and an interrupted write leaves nothing. Non-weight files (config, tokenizer, ...) are copied as
    they are. Several writers (--workers on one machine, or the ranks of a torchrun job) write shares of the
    files into one temporary folder; the result is the same. A quantized SRC needs --dequantize bf16: each chunk
    is then computed from just the source rows and scales it needs, and --workers uses the cores for it.

    Without a shared file system, --node-local under a multi-node torchrun gives each node, at OUT on its own
    disk, the files its ranks load (the mesh must have one rank per process); --ranks writes one node's copy in
    one process. Each copy's reshard.json records the ranks it holds.

    \b
    Example:
      reshard write ./Mixtral-8x7B ./mixtral-fsdp5 --fsdp 5
      reshard write s3://models/GLM-4.6 ./glm-ep8 --fsdp 64 --ep 8
      reshard write deepseek-ai/DeepSeek-V3 ./dsv3-ep8 --fsdp 64 --ep 8 --dequantize bf16 --stream
      torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
          -m reshard write ./Mixtral-8x7B ./mixtral-fsdp5 --fsdp 5
      torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
          -m reshard write s3://models/GLM-4.6 /nvme/glm --fsdp 64 --ep 8 --node-local
      reshard write s3://models/GLM-4.6 /nvme/glm --fsdp 64 --ep 8 --ranks 8-15
    """
    from .api import write_checkpoint

    result = write_checkpoint(src, out, mesh, mode=mode, revision=revision, stream=stream, overwrite=overwrite,
                              max_shard_size=max_shard_size, progress=False if quiet else None, workers=workers,
                              distributed=distributed, dequantize=dequantize, drop_unloaded=drop_unloaded,
                              ranks=ranks, node_local=node_local)
    if result is not None:  # None: another rank of a distributed write; rank 0 prints the summary
        _show(result, as_json)


@cli.command(name="verify", short_help="Check OUT's files and coverage; with --against SRC, every byte.")
@click.argument("out")
@click.option("--against", "against", metavar="SRC", default=None,
              help="The source checkpoint: compare every byte with it.")
@revision_option
@click.option("--no-checksums", is_flag=True, help="Skip recomputing each file's CRC-32 (faster, less thorough).")
@click.option("--ranks", type=RanksType(), default=None,
              help="Check only the files these ranks load (a node's copy staged by hand): 0-7, or 0,8,16-23.")
@quiet_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as a JSON document (also when it fails).")
def verify_command(out, against, revision, no_checksums, ranks, quiet, as_json):
    """Prove OUT complete and exact: files vs manifest, coverage, empty markers; with --against SRC, every byte.

    Prints one line per problem and exits 1 if there is any. This checks the copying (every byte where the
    manifest says, equal to the source bytes reshard's key mapping names), not the mapping itself. OUT may be a
    local folder or an s3:// URL; a plain HF checkpoint (what `reshard merge` writes) is checked as one. A node's
    copy (`write --node-local` or `--ranks`) is checked for the ranks it holds, and the result says which; a copy
    staged by hand (`reshard files --ranks`) is checked with the same --ranks.

    \b
    Example:
      reshard verify ./mixtral-fsdp5 --against ./Mixtral-8x7B
      reshard verify /nvme/glm --ranks 8-15
    """
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


@cli.command(name="files", short_help="List the files RANKS need to load OUT (node-local copies).")
@click.argument("out")
@click.option("--ranks", type=RanksType(), required=True,
              help="Global ranks, counted from 0: 0-7 (one node of 8 GPUs) or 0,8,16-23.")
@json_option
def files_command(out, ranks, as_json):
    """List the files RANKS need to load OUT: the manifest, config and tokenizer files, and their shard files.

    A coordinate is one fsdp rank's position, shared by its HSDP replicas: they load the same files. Each
    coordinate's files hold everything its ranks load, so a node can load from its own copy of just these
    files (node-local NVMe instead of a shared file system). Paths are relative to OUT, one per line. Ranks count
    from 0 and shard files from 1: shard-00003-... holds what the ranks of coordinate 2 load.

    \b
    Example (node 1 of an 8-GPU-per-node job):
      reshard files ./glm-ep8-fsdp64 --ranks 8-15 | rsync -a --files-from=- ./glm-ep8-fsdp64 node1:/nvme/glm
    """
    from .api import list_files

    result = list_files(out, ranks)
    if not as_json:
        click.echo(result.numbering(), err=True)
    _show(result, as_json)


@cli.command(name="merge", short_help="Merge distributed SRC back into DEST, a standard HF checkpoint.")
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
@quiet_option
@json_option
def merge_command(src, dest, max_shard_size, layout, overwrite, extras_from, workers, distributed, node_local, quiet,
                  as_json):
    """Merge SRC, a distributed checkpoint, into DEST, a standard Hugging Face checkpoint.

    SRC is a reshard folder (`reshard write`) or a folder saved by transformers'
    `model.save_pretrained(dir, distributed_checkpoint=True)` on any mesh (EP included), local or s3://. DEST gets
    model-0000N-of-0000M.safetensors files, model.safetensors.index.json and the config and tokenizer files: what
    the Hub, vLLM, SGLang and from_pretrained load. Every tensor is copied byte for byte from the chunks that cover
    it (never the whole model in memory); a tensor the chunks do not cover exactly (a rank file missing, overlapping
    saves, mixed dtypes) is an error naming it, before anything is written. DEST appears only when complete.
    To resume on another mesh instead, `reshard write SRC OUT --fsdp F --ep E` takes the same SRC.

    Without a shared file system, --node-local under the training job's multi-node torchrun merges the rank
    files each node holds at SRC on its own disk (a `write --node-local` folder, or the save each node made):
    node 0's ranks write DEST on node 0's disk (or a shared one), the other nodes serve their files to them over
    the process group, and the CRC-32s a reshard folder records are checked as the bytes pass.

    \b
    Example:
      reshard merge ./ckpt-step1000 ./published            # original layout, 5GB files
      reshard verify ./published --against ./ckpt-step1000 # every tensor equal, byte for byte
      torchrun --nproc-per-node 8 -m reshard merge ./ckpt-step1000 ./published
      torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
          -m reshard merge /nvme/ckpt /nvme/published --node-local
    """
    from .api import merge_checkpoint

    result = merge_checkpoint(src, dest, max_shard_size=max_shard_size, layout=layout, overwrite=overwrite,
                              progress=False if quiet else None, extras_from=extras_from, workers=workers,
                              distributed=distributed, node_local=node_local)
    if result is not None:  # None: another rank of a distributed merge; rank 0 prints the summary
        _show(result, as_json)


@cli.command(short_help="Run the whole job on a tiny generated model (nothing downloaded).")
@click.option("--ranks", type=Count(min=2, max=16), default=4, show_default=True,
              help="CPU processes for the multi-rank load (the mesh is --fsdp RANKS).")
@click.option("--keep", type=click.Path(file_okay=False), metavar="DIR", default=None,
              help="Keep the generated checkpoint, the output and the rank reports in this folder.")
def demo(ranks, keep):
    """Run the whole job on a tiny generated checkpoint: plan, write, a multi-rank CPU load, verify.

    The checkpoint (a 2-layer Qwen3-MoE with RANKS/2 experts) leaves ranks empty under stock transformers;
    the demo shows the plan, writes per-rank files, loads them on RANKS gloo processes with
    reshard.from_pretrained, checks every tensor against a single-process load, and verifies the folder.
    Nothing is downloaded. Without --keep the files are removed at the end (the last line says where they were).
    """
    from .demo import run_demo

    click.echo(run_demo(ranks=ranks, keep=keep, echo=click.echo).summary())


@cli.command(name="env", short_help="Versions, loader-patch hooks, launcher variables: for a bug report.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as a JSON document (reshard_env_version 1).")
def env_command(as_json):
    """Print what a bug report needs: the versions of reshard, Python, torch (and its CUDA), transformers,
    safetensors, huggingface_hub and accelerate; whether each transformers function the loader patch hooks is
    present with the parameters it expects; whether the versions are inside the tested matrix; and the launcher
    variables this process sees (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...).

    Exit 0 even when something is outside the tested matrix: the report says so.

    \b
    Example:
      reshard env            # paste the lines into the issue
      reshard env --json
    """
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
