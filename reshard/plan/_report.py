"""Render a plan for people (`reshard plan`) and as a stable JSON document (`reshard plan --json`)."""

from __future__ import annotations

import re

from ..words import plural
from ._dtypes import DTYPE_BITS
from ._layout import Role
from ._placement import FamilySummary, Kind, ReshardPlan, expert_bytes_per_rank, summarize

PLAN_JSON_VERSION = 1


_MAP_WIDTH = 128  # one character per rank up to this many ranks; runs beyond, so a line stays readable
_MAX_RUNS = 24


def _per_rank_maps(maps: list[tuple[int, ...]]) -> bool:
    """Whether every rank map of one report fits one character per rank: a report uses one notation throughout."""
    return all(max(rows, default=0) < 10 and len(rows) <= _MAP_WIDTH for rows in maps)


def _rank_map(rows: tuple[int, ...], replicated: bool, per_rank: bool = True) -> str:
    """Rows on the split dim per fsdp coordinate, `.` for an empty local.

    `per_rank` (every map of the report qualifies, `_per_rank_maps`): one character per rank (`33333320` for 8 ranks
    of GLM-4.6 stock); otherwise runs, `384 on 64 ranks`, `12 on 3 ranks, . on 1 rank` when the last of 4 ranks is
    empty; past `_MAX_RUNS` runs, the rest is counted.
    """
    if replicated:
        return "all ranks hold it whole"
    if per_rank and max(rows) < 10 and len(rows) <= _MAP_WIDTH:
        return "".join("." if n == 0 else str(n) for n in rows)
    runs: list[list[int]] = []
    for n in rows:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    text = ", ".join(f"{'.' if n == 0 else n} on {plural(count, 'rank')}" for n, count in runs[:_MAX_RUNS])
    return text + (f" ... ({len(runs) - _MAX_RUNS} more runs)" if len(runs) > _MAX_RUNS else "")


def human_bytes(n: float) -> str:
    """`n` bytes as people read them: 512 B, 1.50 KiB, 82.17 GiB."""
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
        **({"extras": _extras_summary(plan)} if plan.layout.extras else {}),
        "summary": stats,
        **({"quantization": _quantization_summary(plan)} if plan.quantization is not None else {}),
    }


def _extras_summary(plan: ReshardPlan) -> dict:
    """The on-disk tensors the model does not load (MTP layers, unexpected keys) and what `write` does with them."""
    extras, patterns = plan.layout.extras, plan.layout.ignore_patterns
    by_class = [t.name for t in extras if any(re.search(p, t.name) for p in patterns)]
    return {
        "tensors": len(extras),
        "bytes": sum(_bytes(t) for t in extras),  # as written: bf16 where a quantized pair is dequantized
        "examples": [t.name for t in extras[:3]],
        "ignored_by_class": len(by_class),  # matched by the class's `_keys_to_ignore_on_load_unexpected`
        "ignore_patterns": list(patterns),
        "unexpected": len(extras) - len(by_class),  # map to no parameter or buffer of the model
        "write": "kept" if plan.extras else "dropped",
        # quantized pairs among them, dequantized like every other weight in a dequantizing write
        "dequantized": sum(plan.quantization.computes(t) for t in extras) if plan.quantization is not None else 0,
    }


def _extras_lines(plan: ReshardPlan) -> list[str]:
    e = _extras_summary(plan)
    why = []
    if e["ignored_by_class"]:
        why.append(f"{e['ignored_by_class']} dropped on purpose (MTP layers...) by {plan.layout.architecture}"
                   f"._keys_to_ignore_on_load_unexpected: {', '.join(e['ignore_patterns'])}")
    if e["unexpected"]:
        why.append(f"{e['unexpected']} map to no parameter or buffer of the model (unexpected keys)")
    if e["dequantized"]:
        why.append(f"{e['dequantized']} are quantized pairs: written dequantized to bf16, like the model's weights")
    if e["write"] == "kept":
        action = ("write: keeps them whole under their own keys in extra-*.safetensors (no rank loads them; CRC-32s "
                  "in reshard.json)\n  merge writes them back; --drop-unloaded leaves them out")
    else:
        action = "write: leaves them out (--drop-unloaded); a merge of the output will not hold them"
    return [f"tensors the model does not load: {e['tensors']} ({human_bytes(e['bytes'])})",
            f"  e.g. {', '.join(e['examples'])}", *(f"  {w}" for w in why), f"  {action}"]


def _quantization_summary(plan: ReshardPlan) -> dict:
    """What a quantized source holds and what `write --dequantize bf16` makes of it."""
    from ._placement import family_of

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
    if any("_StridedShard" in p.describe() for f in families for p in (f.stock, f.planned)):
        lines.append("  (_StridedShard(0, sf=N) is torch's private placement that transformers gives the expert dim "
                     "under EP: it is cut into N EP blocks, each split over efsdp = fsdp/ep ranks)")
    dense_empty = [f for f in families if f.role is not Role.EXPERT and f.stock_empty]
    per_rank = _per_rank_maps([rows for f in families if f.role is Role.EXPERT
                              for rows in (f.stock_rows, f.planned_rows)]
                             + [f.stock_rows for f in dense_empty if f.stock.kind is not Kind.REPLICATED])
    width = max((len(p.describe()) for f in families for p in (f.stock, f.planned)), default=0)
    for f in families:
        if f.role is not Role.EXPERT:
            continue
        lines.append(f"  {f.pattern}  {list(f.shape)} {f.dtype}  ({plural(f.count, 'tensor')})")
        lines.append(f"    stock    {f.stock.describe():{width}s}  {_rank_map(f.stock_rows, False, per_rank)}"
                     + (f"  empty on {plural(len(f.stock_empty), 'rank')}" if f.stock_empty else ""))
        choice = "same as stock" if f.planned == f.stock else f"split dim {f.planned.shard_dim} (divides evenly)"
        if f.planned == f.stock and f.stock_empty:
            choice = "no dim divides evenly: explicit empty markers"
        lines.append(f"    planned  {f.planned.describe():{width}s}  {_rank_map(f.planned_rows, False, per_rank)}"
                     f"  {choice}")
    if dense_empty:
        lines += ["", "dense tensors with empty locals (loaded with explicit empty markers; FSDP handles these):"]
        for f in dense_empty:
            rank_map = _rank_map(f.stock_rows, f.stock.kind is Kind.REPLICATED, per_rank)
            lines.append(f"  {f.pattern}  {list(f.shape)} ({plural(f.count, 'tensor')})  {rank_map}")
    if plan.quantization is not None:
        q = _quantization_summary(plan)
        families = q["dequantized_families"]
        lines += ["", f"quantized source: {q['format']}, {q['quantized_source_tensors']} tensors "
                      f"({human_bytes(q['quantized_source_bytes'])} with scales); planned as the bf16 model "
                      "transformers builds without quantization_config",
                  f"  dequantized: {plural(q['dequantized_tensors'], 'tensor')} in {len(families)} famil"
                  f"{'y' if len(families) == 1 else 'ies'}, e.g. {', '.join(families[:3])}",
                  f"  bf16 output: {human_bytes(q['output_bytes'])} in all ({human_bytes(q['dequantized_bytes'])} "
                  "computed, the rest copied as it is)",
                  "  write: `reshard write SRC OUT ... --dequantize bf16` computes each chunk from just the source "
                  "rows and scales it needs (bounded memory) and writes a config.json without quantization_config"]
    if plan.layout.extras:
        lines += ["", *_extras_lines(plan)]
    lines += [
        "",
        f"summary: stock transformers leaves {plural(stats['stock_empty_tensors'], 'tensor')} empty "
        f"({_experts_among(stats['stock_empty_expert_tensors'])}) {_on_ranks(stats['stock_empty_ranks'])};",
        f"         reshard's layout: {plural(stats['planned_empty_tensors'], 'tensor')} empty "
        f"({_experts_among(stats['planned_empty_expert_tensors'])}) {_on_ranks(stats['planned_empty_ranks'])}, "
        "each an explicit empty marker in each of those ranks' files (one marker per tensor and rank).",
        f"expert bytes per rank, max/mean: stock {human_bytes(stats['stock_expert_bytes_max'])} / "
        f"{human_bytes(stats['stock_expert_bytes_mean'])} = {stats['stock_expert_max_over_mean']:.2f}; planned "
        f"{human_bytes(stats['planned_expert_bytes_max'])} / {human_bytes(stats['planned_expert_bytes_mean'])} = "
        f"{stats['planned_expert_max_over_mean']:.2f}",
        "",
        *expert_bars(*expert_bytes_per_rank(plan)),
    ]
    return "\n".join(lines)


def _spans(ranks: list[int], limit: int = 16) -> str:
    """`0-47`, `2,5,7-9`: runs of consecutive ranks; past `limit` runs, `,...`."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (",..." if len(runs) > limit else "")


def _experts_among(n: int) -> str:
    """`no expert tensor among them`, `1 of them an expert tensor`, `4 of them expert tensors`."""
    return "no expert tensor among them" if n == 0 else f"{n} of them expert tensor{'s' if n != 1 else ''}"


def _on_ranks(ranks: list[int]) -> str:
    """`on no rank`, `on rank 2`, `on 8 ranks (56-63)`."""
    if not ranks:
        return "on no rank"
    return f"on rank {ranks[0]}" if len(ranks) == 1 else f"on {len(ranks)} ranks ({_spans(ranks)})"


BAR_WIDTH = 20
MAX_BAR_GROUPS = 12


def expert_bars(stock: list[int], planned: list[int]) -> list[str]:
    """Each rank's routed-expert bytes, stock against planned, as two bars scaled to the largest rank.

    Ranks with the same pair of figures share one line (48 equal ranks of a 64-rank mesh are one line), listed by
    their first rank; an empty rank shows `EMPTY` where its bar would be, so it stands out in the column of `#`.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, pair in enumerate(zip(stock, planned)):
        groups.setdefault(pair, []).append(rank)
    top = max(stock + planned) or 1

    def bar(n: int) -> str:
        if n == 0:
            return "EMPTY".ljust(BAR_WIDTH)
        return ("#" * max(1, round(BAR_WIDTH * n / top))).ljust(BAR_WIDTH)

    rows = sorted(groups.items(), key=lambda item: item[1][0])
    labels = [("rank " if len(ranks) == 1 else f"{len(ranks)} ranks ") + _spans(ranks, 4)
              for _, ranks in rows[:MAX_BAR_GROUPS]]
    width = max(len(label) for label in labels)
    lines = [f"expert bytes per rank, stock vs planned (# = 1/{BAR_WIDTH} of the largest, {human_bytes(top)}):"]
    for label, ((s, p), _) in zip(labels, rows):
        lines.append(f"  {label:{width}s}  stock {bar(s)} {human_bytes(s):>10s}   planned {bar(p)} "
                     f"{human_bytes(p):>10s}")
    if len(rows) > MAX_BAR_GROUPS:
        rest = sum(len(ranks) for _, ranks in rows[MAX_BAR_GROUPS:])
        lines.append(f"  ... {plural(rest, 'more rank')} in {len(rows) - MAX_BAR_GROUPS} more groups")
    return lines
