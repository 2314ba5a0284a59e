"""Rank script: no transformers loader. Build the HF modeling class on meta, apply EP and FSDP2 by hand, `dcp.load`.

usage: dcp_load.py SRC REPORT_DIR FSDP EP CASE:FOLDER [CASE:FOLDER ...]
CASE: `reshard`   reshard.StorageReader, fully_shard with reshard.shard_placement_fn (the folder's placements)
      `resharded` reshard.StorageReader, fully_shard with FSDP2's default Shard(0) (DCP reshards when the folder's
                  placements differ)
      `torch`     torch's own HuggingFaceStorageReader, default placements
Every file the reshard reader opens is audited (each byte range read, per file). Each rank writes
REPORT_DIR/rank{r}.json: per case, the tensors that differ from the source's in-memory ones, the ranges read, the
files whose CRC-32 was checked, this rank's own files, and each expert tensor's placements and local shape.
"""

import sys

import torch
import torch.distributed as dist

from rank_report import finish, record_failure


class AuditedFile:
    """A file object recording every byte range read through it."""

    def __init__(self, inner, ranges):
        self._inner, self._ranges = inner, ranges

    def readinto(self, buffer):
        start = self._inner.tell()
        n = self._inner.readinto(buffer)
        self._ranges.append([start, start + (n or 0)])
        return n

    def read(self, size=-1):
        start = self._inner.tell()
        data = self._inner.read(size)
        self._ranges.append([start, start + len(data)])
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._inner.close()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def build(folder, mesh_dense, mesh_experts, expert_modules, placement_fn):
    """The HF modeling class on meta, expert parameters Shard(0) on the ep mesh, fully_shard, then real memory."""
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    for path in expert_modules:
        module = model.get_submodule(path)
        for name, param in list(module.named_parameters(recurse=False)):
            module._parameters[name] = torch.nn.Parameter(
                distribute_tensor(param, mesh_experts["ep"], [Shard(0)], src_data_rank=None),
                requires_grad=param.requires_grad)
    fn = placement_fn(model) if placement_fn else None
    for path in expert_modules:
        fully_shard(model.get_submodule(path), mesh=mesh_experts["efsdp"], shard_placement_fn=fn)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh_dense, shard_placement_fn=fn)
    fully_shard(model, mesh=mesh_dense, shard_placement_fn=fn)
    model.to_empty(device="cpu")
    with torch.no_grad():  # anything the load leaves out shows up as NaN / a wrong value
        for tensor in model.state_dict().values():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local.fill_(float("nan") if local.is_floating_point() else 7)
    return model


def main():
    src, report_dir, fsdp, ep, *cases = sys.argv[1:]
    fsdp, ep = int(fsdp), int(ep)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"rank": rank, "cases": {}}
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM

        import reshard
        import reshard.load._storage as storage

        reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
        mesh_dense = init_device_mesh("cpu", (fsdp,), mesh_dim_names=("fsdp",))
        mesh_experts = init_device_mesh("cpu", (fsdp // ep, ep), mesh_dim_names=("efsdp", "ep"))
        reads: dict[str, list] = {}
        open_file = storage._open
        storage._open = lambda store, name: AuditedFile(open_file(store, name), reads.setdefault(name, []))
        for case_folder in cases:
            case, folder = case_folder.split(":", 1)
            reads.clear()
            manifest = reshard.read_manifest(folder)
            experts = sorted({n.rsplit(".", 1)[0] for n, i in manifest.tensors.items() if i.role == "expert"})
            placement_fn = (lambda model: reshard.shard_placement_fn(folder, model)) if case == "reshard" else None
            model = build(folder, mesh_dense, mesh_experts, experts, placement_fn)
            reader = HuggingFaceStorageReader(folder) if case == "torch" else reshard.StorageReader(folder)
            dcp.load(model.state_dict(), storage_reader=reader)
            mismatched, local = [], {}
            for name, tensor in model.state_dict().items():
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                if full.dtype != reference[name].dtype or not torch.equal(full, reference[name]):
                    mismatched.append(name)
                if name in manifest.tensors and manifest.tensors[name].role == "expert":
                    local[name] = [str(tensor.placements), list(tensor.to_local().shape)]
            report["cases"][case_folder] = {
                "mismatched": mismatched, "tensors": len(reference), "local": local,
                "reads": {name: ranges for name, ranges in reads.items()},
                "checked": getattr(reader, "checked_files", None), "unchecked": getattr(reader, "unchecked_files", None),
                "own": manifest.files_of_rank(rank),
                "sizes": {f.name: f.bytes for f in manifest.files},
            }
    except BaseException as e:  # report everything: the test asserts on it
        record_failure(report, e, 4000)
    finish(report_dir, report)


if __name__ == "__main__":
    main()
