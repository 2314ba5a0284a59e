"""The help text of each `reshard` command (its --help page), kept apart from the flags and the one call each
command makes (`reshard.cli`)."""

CLI_HELP = """Plan, write, verify, merge per-rank MoE checkpoints for FSDP2 x EP meshes.

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

PLAN_HELP = """Show how SRC would be sharded on the mesh, stock vs reshard, from headers only.

    Reads config.json, the index and the safetensors headers (never tensor data), finds the routed experts with
    transformers' conversion mapping, simulates transformers + FSDP2 for every tensor and rank, flags every empty
    local, and shows the layout `reshard write` would produce. SRC is anything `write` takes.

    \b
    Example:
      reshard plan zai-org/GLM-4.6 --fsdp 64 --ep 8
      reshard plan s3://models/GLM-4.6 --fsdp 64 --ep 8
    """

WRITE_HELP = """Write SRC as per-rank shard files for the mesh into OUT, plus reshard.json.

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

VERIFY_HELP = """Prove OUT complete and exact: files vs manifest, coverage, empty markers; with --against SRC,
    every byte.

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

FILES_HELP = """List the files RANKS need to load OUT: the manifest, config and tokenizer files, and their shard files.

    A coordinate is one fsdp rank's position, shared by its HSDP replicas: they load the same files. Each
    coordinate's files hold everything its ranks load, so a node can load from its own copy of just these
    files (node-local NVMe instead of a shared file system). Paths are relative to OUT, one per line. Ranks count
    from 0 and shard files from 1: shard-00003-... holds what the ranks of coordinate 2 load.

    \b
    Example (node 1 of an 8-GPU-per-node job):
      reshard files ./glm-ep8-fsdp64 --ranks 8-15 | rsync -a --files-from=- ./glm-ep8-fsdp64 node1:/nvme/glm
    """

MERGE_HELP = """Merge SRC, a distributed checkpoint, into DEST, a standard Hugging Face checkpoint.

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

DEMO_HELP = """Run the whole job on a tiny generated checkpoint: plan, write, a multi-rank CPU load, verify.

    The checkpoint (a 2-layer Qwen3-MoE with RANKS/2 experts) leaves ranks empty under stock transformers;
    the demo shows the plan, writes per-rank files, loads them on RANKS gloo processes with
    reshard.from_pretrained, checks every tensor against a single-process load, and verifies the folder.
    Nothing is downloaded. Without --keep the files are removed at the end (the last line says where they were).
    """

ENV_HELP = """Print what a bug report needs: the versions of reshard, Python, torch (and its CUDA), transformers,
    safetensors, huggingface_hub and accelerate; whether each transformers function the loader patch hooks is
    present with the parameters it expects; whether the versions are inside the tested matrix; and the launcher
    variables this process sees (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...).

    Exit 0 even when something is outside the tested matrix: the report says so.

    \b
    Example:
      reshard env            # paste the lines into the issue
      reshard env --json
    """
