"""One rank of `bench/load.py`: load a checkpoint with stock transformers or with reshard, report what it read.

usage (under torchrun): load_rank.py MODE FOLDER FSDP REPORT_DIR
    MODE: `stock`          `AutoModelForCausalLM.from_pretrained(FOLDER,
                                                             distributed_config=DistributedConfig(fsdp_size=FSDP))`
          `reshard`        `reshard.from_pretrained(FOLDER)`: `dcp.load` of the model's state dict with
                           `reshard.StorageReader`, each rank reading its own files into its local shards, CRC-32
                           computed as the bytes pass (the default)
          `reshard-nocrc`  the same with `check_checksums=False`
          `reshard-dcp`    `reshard.from_pretrained(FOLDER)` with transformers' own `_load_model_checkpoint_distributed`
                           (state dict gathered and redistributed, `dcp.load` with torch's `HuggingFaceStorageReader`,
                           which opens every file's header; no CRC)

Environment switches:
    BENCH_VERIFY=1      after the timed load, write a SHA-1 of every local shard (with its placement, shape and
                        global offset) to the report, to compare loaders rank by rank.
    BENCH_PROFILE=R     rank R runs `from_pretrained` under cProfile and dumps the stats to REPORT_DIR/profile.pstats.

Each rank writes REPORT_DIR/rank{r}.json with:
- `times`: epoch seconds of process start (from /proc), script start, after `import torch`, after
  `init_process_group`, after the transformers (and reshard) imports, and around `from_pretrained` (all ranks leave
  a barrier just before it, so `from_pretrained` seconds are comparable across ranks);
- `phases`: [label, start, end, depth] intervals of the main internal steps (functions wrapped by `install_phases`,
  main thread only);
- `reads`: what this rank materialized through safetensors: every `safe_open` is proxied (files opened, per
  phase), every slice `__getitem__` / `get_tensor` result counted (bytes of the returned tensor, per file and per
  phase). Stock and the DCP path read tensor data through safetensors' whole-file mmap (no read() syscalls), so
  this is the measure of tensor bytes read; it does not see kernel readahead / fault-around. reshard's
  reads bypass safetensors: the files `reshard.StorageReader` opens are wrapped to count every byte read. (The resident size of each file's mapping
  in /proc/self/smaps was tried and dropped: after copying 143 MB out of a safe_open'd file, its mapping showed
  5.5 MB resident.)
- `io`: /proc/self/io before and after `from_pretrained` (rchar = bytes through read()/pread() syscalls: the CRC
  pre-check and header reads show there, mmap reads do not; read_bytes = bytes fetched from the block device:
  0 on a warm page cache);
- `load_cpu_s`: CPU seconds (all threads) this process spent in `from_pretrained` (less sensitive than wall time to
  other jobs on the machine; excludes time blocked in collectives);
- `share`: bytes of this rank's local tensors after the load (its own share), `maxrss_kib`
  (`getrusage(RUSAGE_SELF).ru_maxrss`, i.e. VmHWM: it counts file pages touched through mmap while mapped, so the
  mmap-based loaders peak about one share higher than reshard's own-file reads).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import threading
import time

T_SCRIPT = time.time()


def _process_start() -> float:
    """Epoch seconds at which this process started: its age (/proc/uptime minus the start tick in /proc/self/stat,
    10 ms resolution) subtracted from now. (/proc/stat's btime is whole seconds: too coarse.)"""
    now = time.time()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3
    return now - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def _proc_io() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key.strip()] = int(value)
    return out


# ---- phases --------------------------------------------------------------------------------------------------

_phases: list[list] = []
_stack: list[str] = []
_phase_lock = threading.Lock()


def _current_phase() -> str:
    return _stack[-1] if _stack else "-"


def _timed(label: str, func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return func(*args, **kwargs)
        depth = len(_stack)
        _stack.append(label)
        start = time.time()
        try:
            return func(*args, **kwargs)
        finally:
            _stack.pop()
            _phases.append([label, start, time.time(), depth])

    return wrapper


def _wrap(owner, name: str, label: str) -> None:
    raw = owner.__dict__[name]
    if isinstance(raw, staticmethod):
        setattr(owner, name, staticmethod(_timed(label, raw.__func__)))
    elif isinstance(raw, classmethod):
        setattr(owner, name, classmethod(_timed(label, raw.__func__)))
    else:
        setattr(owner, name, _timed(label, raw))


def install_phases(mode: str, model_cls) -> None:
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dcp_sd
    import transformers.distributed.checkpoint as tdc
    import transformers.distributed.mixin as mixin
    import transformers.modeling_utils as mu
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    def definer(name):
        return next(c for c in mu.PreTrainedModel.__mro__ if name in c.__dict__)

    targets = [
        (mu, "_get_resolved_checkpoint_files", "resolve checkpoint files"),
        (mu, "_get_resolved_distributed_checkpoint_files", "resolve checkpoint files (distributed)"),
        (mu, "_get_dtype", "_get_dtype"),
        (model_cls, "__init__", "model __init__ on meta"),
        (mu, "get_model_conversion_mapping", "get_model_conversion_mapping"),
        (definer("maybe_distribute_model"), "maybe_distribute_model", "distribute (EP/FSDP plans)"),
        (mixin, "apply_fully_sharded_data_parallelism", "fully_shard"),
        (mu.PreTrainedModel, "_load_pretrained_model", "stock: read+convert+shard (_load_pretrained_model)"),
        (mu, "convert_and_load_state_dict_in_model", "stock: convert_and_load_state_dict_in_model"),
        (mu.PreTrainedModel, "_finalize_model_loading", "finalize (_finalize_model_loading)"),
        (mu.PreTrainedModel, "_move_missing_keys_from_meta_to_device", "materialize meta -> cpu"),
        (mu.PreTrainedModel, "_initialize_missing_keys", "initialize missing keys"),
        (definer("_load_and_finalize_distributed_pretrained_model"), "_load_and_finalize_distributed_pretrained_model",
         "DCP path: load + finalize"),
        (mixin, "_load_model_checkpoint_distributed", "DCP: _load_model_checkpoint_distributed"),
        (dcp, "load", "DCP: dcp.load"),
        (HuggingFaceStorageReader, "read_metadata", "DCP: read_metadata (every file's header)"),
        (HuggingFaceStorageReader, "read_data", "DCP: read_data"),
        (dcp_sd, "get_model_state_dict", "DCP: get_model_state_dict"),
        (dcp_sd, "set_model_state_dict", "DCP: set_model_state_dict"),
        (tdc, "_redistribute_state_dict", "DCP: _redistribute_state_dict"),
        (mu.PreTrainedModel, "initialize_weights", "initialize_weights"),
        (mu, "_get_device_map", "_get_device_map"),
        (next(c for c in model_cls.__mro__ if "adjust_generation_fn" in c.__dict__), "adjust_generation_fn",
         "adjust_generation_fn (generation config)"),
    ]
    if mode != "stock":
        import reshard.load._agreement as agreement
        import reshard.load._loader as rl
        import reshard.load._storage as storage

        targets += [
            (agreement, "read_manifest", "reshard: read_manifest"),
            (agreement, "_check_own_files", "reshard: check own files (size, header)"),
            (agreement, "gather", "reshard: all_gather_object"),
            (rl, "_model_class", "reshard: _model_class"),
            (storage, "load_model_state", "reshard: dcp.load with reshard.StorageReader"),
            (storage.StorageReader, "read_metadata", "reshard: StorageReader.read_metadata (manifest)"),
            (storage.StorageReader, "read_data", "reshard: StorageReader.read_data (own files)"),
        ]
    for owner, name, label in targets:
        if name in owner.__dict__:
            _wrap(owner, name, label)


# ---- reads ---------------------------------------------------------------------------------------------------

class ReadCounter:
    def __init__(self):
        self.lock = threading.Lock()
        self.opens: dict[str, int] = {}            # file -> number of safe_open calls
        self.opens_by_phase: dict[str, int] = {}
        self.data: dict[str, int] = {}             # file -> bytes of tensors materialized from it
        self.data_by_phase: dict[str, int] = {}
        self.slices = 0

    def opened(self, name):
        with self.lock:
            self.opens[name] = self.opens.get(name, 0) + 1
            phase = _current_phase()
            self.opens_by_phase[phase] = self.opens_by_phase.get(phase, 0) + 1

    def got(self, name, tensor, phase):
        self.got_bytes(name, tensor.numel() * tensor.element_size(), phase)

    def got_bytes(self, name, n, phase):
        with self.lock:
            self.slices += 1
            self.data[name] = self.data.get(name, 0) + n
            self.data_by_phase[phase] = self.data_by_phase.get(phase, 0) + n


class _Slice:
    def __init__(self, inner, owner):
        self._inner, self._owner = inner, owner

    def __getitem__(self, key):
        tensor = self._inner[key]
        self._owner._counter.got(self._owner._name, tensor, self._owner._phase())
        return tensor

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


class _File:
    def __init__(self, inner, path, counter):
        self._inner, self._counter = inner, counter
        self._name = os.path.basename(path)
        self._open_phase = _current_phase()  # worker threads see no stack: attribute their reads to the opener
        counter.opened(self._name)

    def _phase(self):
        return _current_phase() if threading.current_thread() is threading.main_thread() else self._open_phase

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def get_slice(self, key):
        return _Slice(self._inner.get_slice(key), self)

    def get_tensor(self, key):
        tensor = self._inner.get_tensor(key)
        self._counter.got(self._name, tensor, self._phase())
        return tensor

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


def install_read_counter() -> ReadCounter:
    import safetensors
    import transformers.modeling_utils as mu

    counter = ReadCounter()
    original = safetensors.safe_open

    def safe_open(filename, framework, *args, **kwargs):
        return _File(original(filename, framework, *args, **kwargs), os.fspath(filename), counter)

    safetensors.safe_open = safe_open  # torch's HuggingFaceStorageReader imports it from the module at each call
    mu.safe_open = safe_open           # transformers imported the name at import time
    return counter


# ---- reshard's own-file reads -------------------------------------------------------------------------------

class _CountedFile:
    """A file `reshard.load._storage` opened: every byte read through it is counted (headers included)."""

    def __init__(self, inner, name, counter):
        self._inner, self._name, self._counter = inner, name, counter

    def readinto(self, buffer):
        n = self._inner.readinto(buffer)
        self._counter.got_bytes(self._name, n or 0, _current_phase())
        return n

    def read(self, size=-1):
        data = self._inner.read(size)
        self._counter.got_bytes(self._name, len(data), _current_phase())
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._inner.close()

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


def install_reshard_reads(mode: str, counter: ReadCounter) -> None:
    """Count what `reshard.StorageReader` reads (every file it opens, every byte); for `reshard-dcp`, give
    transformers back its own distributed-checkpoint load."""
    import reshard.load._storage as storage

    open_file = storage._open

    def counted_open(path):
        counter.opened(path.name)
        return _CountedFile(open_file(path), path.name, counter)

    storage._open = counted_open
    if mode == "reshard-dcp":
        import transformers.distributed.mixin as mixin

        import reshard.load._patch as patch

        mixin._load_model_checkpoint_distributed = patch._originals[(mixin, "_load_model_checkpoint_distributed")]


# ---- main ----------------------------------------------------------------------------------------------------

def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def main() -> None:
    mode, folder, fsdp, report_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    times = {"process_start": _process_start(), "script_start": T_SCRIPT}
    import torch

    times["torch_imported"] = time.time()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    times["process_group"] = time.time()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    transformers.logging.set_verbosity_error()
    if mode != "stock":
        import reshard
        import reshard.load._loader  # noqa: F401  (what reshard.from_pretrained imports on first use)

        reshard.patch_transformers()  # idempotent: installed now so the phase timers wrap the patched functions
    config = AutoConfig.from_pretrained(folder)
    model_cls = getattr(transformers, config.architectures[0])
    times["imports"] = time.time()

    counter = install_read_counter()
    if mode != "stock":
        install_reshard_reads(mode, counter)
    install_phases(mode, model_cls)
    profile_rank = os.environ.get("BENCH_PROFILE")
    profiler = None
    if profile_rank is not None and int(profile_rank) == rank:
        import cProfile

        profiler = cProfile.Profile()

    dist.barrier()
    io_before = _proc_io()
    times["load_start"] = time.time()
    cpu_start = time.process_time()
    if profiler:
        profiler.enable()
    if mode == "stock":
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(fsdp_size=fsdp),
                                                     use_kernels=False)
    else:
        model = reshard.from_pretrained(folder, check_checksums=(mode != "reshard-nocrc"))
    if profiler:
        profiler.disable()
    times["load_end"] = time.time()
    cpu_s = time.process_time() - cpu_start
    io_after = _proc_io()
    dist.barrier()
    times["all_loaded"] = time.time()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    share = sum(_local(t).numel() * _local(t).element_size() for t in model.state_dict().values())
    report = {
        "rank": rank, "mode": mode, "times": times,
        "load_s": times["load_end"] - times["load_start"], "load_cpu_s": cpu_s,
        "phases": _phases,
        "reads": {"opens": counter.opens, "opens_by_phase": counter.opens_by_phase, "data": counter.data,
                  "data_by_phase": counter.data_by_phase, "slices": counter.slices},
        "io": {k: io_after[k] - io_before[k] for k in io_after},
        "share": share, "maxrss_kib": maxrss,
        "local_shapes": {n: list(_local(t).shape) for n, t in model.state_dict().items() if ".experts." in n},
    }
    if profiler:
        profiler.dump_stats(os.path.join(report_dir, "profile.pstats"))
    if os.environ.get("BENCH_VERIFY") == "1":
        # Per rank, no collectives: SHA-1 of every local shard with its placement, local shape and global offset.
        # Comparable between loaders that place tensors alike (the driver checks that they do). (A first version
        # gathered every tensor with full_tensor() and hashed on rank 0; at 1.6 GB a rank intermittently died with
        # "terminate called without an active exception" (SIGABRT), so it was replaced.)
        import hashlib

        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        hashes = {}
        for name, tensor in model.state_dict().items():
            local = _local(tensor)
            where = [str(tensor.placements), list(local.shape), list(compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements)[1])] if isinstance(tensor, DTensor) else \
                ["plain", list(local.shape), [0] * local.dim()]
            digest = hashlib.sha1(local.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            hashes[name] = [digest, *where]
        report["sha1"] = hashes
        report["uninitialized"] = [n for n, p in model.named_parameters()
                                   if not getattr(p, "_is_hf_initialized", False)]
    times["report"] = time.time()
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()  # no rank tears gloo down while another is still in a collective (seen: SIGABRT at 1.6 GB)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
