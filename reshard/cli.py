"""The `reshard` command line: plan, write, verify, demo.

Each command validates its flags, calls one library function and prints a summary (or `--json`). Errors reach
the user through one boundary (`ReshardGroup.invoke`): a `ReshardError` becomes its message and exit 1, a bad
call exits 2, `--debug` shows the traceback.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from .errors import MeshError, ReshardError


class ReshardGroup(click.Group):
    """The single error boundary: domain errors print their message (exit 1) unless --debug."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ReshardError as e:
            if ctx.params.get("debug"):
                raise
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt:
            click.echo("interrupted; nothing partial was left behind.", err=True)
            sys.exit(130)


def mesh_options(func):
    """The mesh flags shared by every command, mirroring transformers' DistributedConfig."""

    @click.option("--fsdp", type=click.IntRange(min=1), required=True,
                  help="fsdp_size: ranks sharding every parameter (with EP, experts use efsdp = fsdp*tp/ep).")
    @click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
                  help="ep_size: expert-parallel ranks; must divide fsdp and the number of experts.")
    @click.option("--dp-replicate", type=click.IntRange(min=1), default=1, show_default=True,
                  help="dp_replicate_size: HSDP replicas; replicas share the same files.")
    @click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                  help="tp_size: tensor parallelism (not supported yet: must be 1).")
    @click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True,
                  help="pp_size: pipeline parallelism (not supported yet: must be 1).")
    @functools.wraps(func)
    def wrapper(*args, fsdp, ep, dp_replicate, tp, pp, **kwargs):
        from .mesh import MeshSpec

        try:
            mesh = MeshSpec(fsdp=fsdp, ep=ep, dp_replicate=dp_replicate, tp=tp, pp=pp)
        except MeshError as e:
            raise click.UsageError(str(e)) from e
        return func(*args, mesh=mesh, **kwargs)

    return wrapper


layout_option = click.option(
    "--layout", "mode", type=click.Choice(["balanced", "stock"]), default="balanced", show_default=True,
    help="balanced: split uneven expert tensors on an even dim (needs reshard's loader patch); "
         "stock: shard exactly like transformers (loads with stock transformers, empty markers where needed).")
revision_option = click.option("--revision", default=None, help="Hub branch, tag or commit (Hub sources only).")


@click.group(cls=ReshardGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="reshard")
def cli(debug):
    """Load MoE checkpoints on FSDP2 x expert-parallel meshes without empty ranks, hangs or full reads.

    \b
    Typical flow:
      reshard plan  SRC --fsdp 64 --ep 8        # what would happen, read from headers only
      reshard write SRC OUT --fsdp 64 --ep 8    # per-rank files + reshard.json
      reshard verify OUT --against SRC          # coverage and bit-identity
    then, in each rank of a torchrun job: reshard.from_pretrained(OUT).

    SRC is a checkpoint folder, a .safetensors file, or a Hub repo id (org/name).
    """


@cli.command()
@click.argument("src")
@mesh_options
@layout_option
@revision_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as a JSON document (reshard_plan_version 1).")
def plan(src, mesh, mode, revision, as_json):
    """Show how SRC would be sharded on the mesh, stock vs reshard, from headers only.

    Reads config.json, the index and the safetensors headers (never tensor data), finds the routed experts with
    transformers' conversion mapping, simulates transformers + FSDP2 for every tensor and rank, flags every empty
    local, and shows the layout `reshard write` would produce.

    \b
    Example:
      reshard plan zai-org/GLM-4.6 --fsdp 64 --ep 8
    """
    from .api import plan_checkpoint
    from .report import plan_to_dict, render_plan

    result = plan_checkpoint(src, mesh, mode=mode, revision=revision)
    if result is None:
        click.echo(f"{src}: no routed experts found (not a MoE checkpoint); nothing to reshard.")
        return
    if as_json:
        click.echo(json.dumps(plan_to_dict(result, src), indent=2))
    else:
        click.echo(render_plan(result, src))


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="reshard")
