"""Render a plan for people (`reshard plan`) and as a stable JSON document (`reshard plan --json`)."""

from __future__ import annotations

from .layout import Role
from .placement import FamilySummary, Kind, ReshardPlan, summarize

PLAN_JSON_VERSION = 1


def _rank_map(rows: tuple[int, ...], replicated: bool) -> str:
    """Rows on the split dim per fsdp coordinate, `.` for an empty local.

    One character per rank while every count is a single digit (`33333320` x 8 for GLM-4.6 stock); otherwise runs,
    `384x64` for 64 ranks of 384 rows, `12x3 .x1` when the last of 4 ranks is empty.
    """
    if replicated:
        return "all ranks hold it whole"
    if max(rows) < 10:
        return "".join("." if n == 0 else str(n) for n in rows)
    runs: list[list[int]] = []
    for n in rows:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return " ".join(f"{'.' if n == 0 else n}x{count}" for n, count in runs)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def plan_to_dict(plan: ReshardPlan, source: str) -> dict:
    """The `--json` document. Version 1 fields are stable; new fields may be added."""
    families, stats = summarize(plan)
    return {
        "reshard_plan_version": PLAN_JSON_VERSION,
        "source": source,
        "model_type": plan.layout.model_type,
        "architecture": plan.layout.architecture,
        "mesh": {**plan.mesh.to_dict(), "efsdp": plan.mesh.efsdp, "world_size": plan.mesh.world_size},
        "distributed_config": plan.mesh.distributed_config_repr(),
        "layout": plan.mode.value,
        "families": [_family_dict(f) for f in families],
        "ignored_sources": list(plan.layout.ignored_sources),
        "summary": stats,
        **({"quantization": quantization_summary(plan)} if plan.quantization is not None else {}),
    }


def quantization_summary(plan: ReshardPlan) -> dict:
    """What a quantized source holds and what `write --dequantize bf16` makes of it."""
    from .placement import family_of

    q = plan.quantization
    computed = [tp.tensor for tp in plan.tensors if q.computes(tp.tensor)]
    total = sum(_bytes(tp.tensor) for tp in plan.tensors)  # the view's dtypes: BF16 where computed
    return {
        "method": q.method,
        "format": q.describe(),
        "quantization_config": q.config,
        "quantized_source_tensors": len(q.tensors),
        "quantized_source_bytes": q.quantized_bytes,
        "dequantized_tensors": len(computed),
        "dequantized_families": sorted({family_of(t.name) for t in computed}),
        "dequantized_bytes": sum(t.numel * 2 for t in computed),
        "output_bytes": total,
        "write": "reshard write SRC OUT ... --dequantize bf16",
    }


def _bytes(tensor) -> int:
    from ..read.checkpoint import DTYPE_BITS

    return tensor.numel * DTYPE_BITS[tensor.dtype] // 8


def _family_dict(f: FamilySummary) -> dict:
    def side(placement, rows, empty):
        return {"placement": placement.describe(), "shard_dim": placement.shard_dim,
                "rows_per_rank": list(rows), "empty_ranks": list(empty)}

    return {"pattern": f.pattern, "role": f.role.value, "count": f.count, "shape": list(f.shape), "dtype": f.dtype,
            "stock": side(f.stock, f.stock_rows, f.stock_empty),
            "planned": side(f.planned, f.planned_rows, f.planned_empty)}


def render_plan(plan: ReshardPlan, source: str) -> str:
    """The human report: mesh, expert families (stock vs planned, rank maps), dense empties, summary."""
    families, stats = summarize(plan)
    mesh = plan.mesh
    lines = [
        f"source: {source} ({plan.layout.model_type}, {plan.layout.architecture}), {stats['tensors']} tensors, "
        f"{stats['expert_tensors']} routed-expert tensors",
        f"mesh:   {mesh.describe()}",
        f"load with: {mesh.distributed_config_repr()}"
        + ("" if mesh.dp_replicate == 1 else "  (ranks below are fsdp coordinates; replicas share them)"),
        "",
        "routed experts (rank map: rows on the split dim per rank, '.' = empty local)",
    ]
    width = max((len(p.describe()) for f in families for p in (f.stock, f.planned)), default=0)
    for f in families:
        if f.role is not Role.EXPERT:
            continue
        lines.append(f"  {f.pattern}  {list(f.shape)} {f.dtype}  x{f.count}")
        lines.append(f"    stock    {f.stock.describe():{width}s}  {_rank_map(f.stock_rows, False)}"
                     + (f"  empty on {len(f.stock_empty)} rank(s)" if f.stock_empty else ""))
        choice = "same as stock" if f.planned == f.stock else f"split dim {f.planned.shard_dim} (divides evenly)"
        if f.planned == f.stock and f.stock_empty:
            choice = "no dim divides evenly: explicit empty markers"
        lines.append(f"    planned  {f.planned.describe():{width}s}  {_rank_map(f.planned_rows, False)}  {choice}")
    dense_empty = [f for f in families if f.role is not Role.EXPERT and f.stock_empty]
    if dense_empty:
        lines += ["", "dense tensors with empty locals (loaded with explicit empty markers; FSDP handles these):"]
        for f in dense_empty:
            lines.append(f"  {f.pattern}  {list(f.shape)} x{f.count}  {_rank_map(f.stock_rows, f.stock.kind is Kind.REPLICATED)}")
    if plan.quantization is not None:
        q = quantization_summary(plan)
        families = q["dequantized_families"]
        lines += ["", f"quantized source: {q['format']}, {q['quantized_source_tensors']} tensors "
                      f"({_human_bytes(q['quantized_source_bytes'])} with scales); planned as the bf16 model "
                      "transformers builds without quantization_config",
                  f"  dequantized: {q['dequantized_tensors']} tensor(s) in {len(families)} famil"
                  f"{'y' if len(families) == 1 else 'ies'}, e.g. {', '.join(families[:3])}",
                  f"  bf16 output: {_human_bytes(q['output_bytes'])} in all ({_human_bytes(q['dequantized_bytes'])} "
                  "computed, the rest copied as it is)",
                  "  write: `reshard write SRC OUT ... --dequantize bf16` computes each chunk from just the source "
                  "rows and scales it needs (bounded memory) and writes a config.json without quantization_config"]
    ignored = plan.layout.ignored_sources
    if ignored:
        lines += ["", f"ignored on-disk keys (the model does not use them): {len(ignored)}, e.g. {ignored[0]}"]
    lines += [
        "",
        f"summary: stock transformers leaves {stats['stock_empty_tensors']} tensor(s) empty "
        f"({stats['stock_empty_expert_tensors']} routed-expert) on {len(stats['stock_empty_ranks'])} rank(s) "
        f"{_ranks(stats['stock_empty_ranks'])}; reshard's layout: {stats['planned_empty_tensors']} "
        f"({stats['planned_empty_expert_tensors']} routed-expert) on {len(stats['planned_empty_ranks'])} rank(s), "
        "each an explicit empty marker.",
        f"expert bytes per rank, max/mean: stock {_human_bytes(stats['stock_expert_bytes_max'])} / "
        f"{_human_bytes(stats['stock_expert_bytes_mean'])} = {stats['stock_expert_max_over_mean']:.2f}; planned "
        f"{_human_bytes(stats['planned_expert_bytes_max'])} / {_human_bytes(stats['planned_expert_bytes_mean'])} = "
        f"{stats['planned_expert_max_over_mean']:.2f}",
    ]
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return ""
    shown = ",".join(map(str, ranks[:16])) + (",..." if len(ranks) > 16 else "")
    return f"({shown})"
