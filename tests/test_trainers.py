"""Real trainers on reshard folders: transformers' `Trainer` and TRL's `SFTTrainer` on 4 gloo ranks, and `Trainer`
under `accelerate launch --use_fsdp --fsdp_version 2` on 2 CPU processes.

One source (a tiny Qwen3-MoE with 6 experts and a tokenizer built here) written twice: the balanced layout at
fsdp 4 x ep 2 (experts split on dim 1) and the stock layout at fsdp 4, which leaves rank 3 without experts (rows
[2, 2, 2, 0]). One torchrun launch trains both trainers on both folders: `reshard.from_pretrained`, a few steps,
`save_pretrained(..., distributed_checkpoint=True)`, rank 0 keeping the trained `full_tensor()`s. The losses must
be finite, fall, and be the same on every rank; then `reshard merge` of each saved folder, loaded whole in this
process by plain transformers, must equal the trained weights bit for bit.

accelerate turns on FSDP_CPU_RAM_EFFICIENT_LOADING, under which transformers leaves the parameters of every rank
but 0 on meta for rank 0 to broadcast later; for a reshard folder the patch has every rank load its own bytes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from reshard.api import write_checkpoint
from reshard.cli import cli
from reshard.plan import MeshSpec

from conftest import RANK_SCRIPTS, rank_reports, run_ranks

# Eight words each: one length in tokens, so no padding.
CORPUS = [
    "the small model learns to say these words",
    "every rank reads only its own bytes here",
    "experts are split evenly over the ranks today",
    "the loss falls when the model sees words",
    "a tiny tokenizer knows only words it saw",
    "four ranks train together and save their shards",
    "the merged folder loads in one single process",
    "nothing is downloaded and nothing is left empty",
]
STEPS = 5
LAYOUTS = {  # name -> (mesh, layout)
    "balanced": (MeshSpec(fsdp=4, ep=2), "balanced"),
    "stock": (MeshSpec(fsdp=4), "stock"),
}
CASES = [(trainer, layout) for layout in LAYOUTS for trainer in ("trainer", "sft")]


def save_tokenizer(folder, corpus) -> None:
    """A word-level tokenizer trained on `corpus`, saved into `folder` (so `reshard write` copies it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="[EOS]").save_pretrained(folder)


@pytest.fixture(scope="module")
def source(tiny, tmp_path_factory):
    """The tiny checkpoint with its tokenizer, and the corpus file the rank script trains on."""
    root = tmp_path_factory.mktemp("trainers")
    src = shutil.copytree(tiny("qwen3_moe", experts=6), root / "src")  # a copy: the session's tiny stays as it is
    save_tokenizer(src, CORPUS)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    return root, src, corpus


def reports_of(folder, nproc) -> list[dict]:
    reports = rank_reports(folder, nproc)
    for report in reports:
        assert "error" not in report, report.get("traceback", report)
    return reports


@pytest.fixture(scope="module")
def trained(source):
    """Both trainers on both layouts, in one 4-rank launch: (case -> its report entry, save dir, trained file)."""
    root, src, corpus = source
    args, paths = [], {}
    for layout, (mesh, mode) in LAYOUTS.items():
        write_checkpoint(src, root / layout, mesh, mode=mode, progress=False)
        assert (root / layout / "tokenizer.json").is_file()  # write copied the tokenizer
    for trainer, layout in CASES:
        name = f"{trainer}-{layout}"
        paths[trainer, layout] = root / f"{name}-saved", root / f"{name}-trained.safetensors"
        args += [trainer, root / layout, *paths[trainer, layout]]
    (root / "reports").mkdir()
    run_ranks("trainers.py", 4, root / "reports", STEPS, corpus, *args, timeout=420)
    reports = reports_of(root / "reports", 4)
    return {case: (reports[0]["cases"][i], *paths[case]) for i, case in enumerate(CASES)}


def check_training(case: dict, nproc: int, *, ram_efficient: bool) -> list[float]:
    """Every rank logged the same finite, falling losses and found the same fixed-batch losses; returns the losses."""
    ranks = case["ranks"]
    assert len(ranks) == nproc
    losses = ranks[0]["logged"]
    print(f"{case['trainer']} on {case['folder']} ({ranks[0]['distributed_type']}): losses per step {losses}, "
          f"fixed batch {ranks[0]['before']} -> {ranks[0]['after']}")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses  # a tiny model on eight sentences learns fast
    assert ranks[0]["after"] < ranks[0]["before"] - 0.5
    for seen in ranks:  # the same numbers on every rank, the fixed batch computed by each rank alone
        assert (seen["logged"], seen["before"], seen["after"]) == (losses, ranks[0]["before"], ranks[0]["after"])
        assert seen["distributed_type"] == "DistributedType.MULTI_CPU", seen  # gloo, each rank its share
        assert seen["ram_efficient_loading"] is ram_efficient
    return losses


@pytest.mark.slow  # Trainer, SFTTrainer and accelerate on 4 ranks
@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("trainer", ["trainer", "sft"])
def test_trainer_trains_on_both_layouts(trained, trainer):
    balanced = check_training(trained[trainer, "balanced"][0], 4, ram_efficient=False)
    stock = check_training(trained[trainer, "stock"][0], 4, ram_efficient=False)
    # The same model and data on two layouts: the same losses up to the order of floating-point sums.
    assert balanced == pytest.approx(stock, rel=1e-4, abs=1e-4)
    assert trained[trainer, "balanced"][0]["ranks"][0]["before"] == trained[trainer, "stock"][0]["ranks"][0]["before"]


def check_saved(saved, trained_file, dest, src) -> None:
    """`reshard merge saved dest`, then one plain process's `from_pretrained(dest)` equals the trained weights, every
    one of which differs from the source's."""
    from transformers import AutoModelForCausalLM

    result = CliRunner().invoke(cli, ["merge", str(saved), str(dest), "-q"])
    assert result.exit_code == 0, result.output
    trained = load_file(trained_file)
    loaded = AutoModelForCausalLM.from_pretrained(dest, use_kernels=False).state_dict()
    assert loaded.keys() == trained.keys()
    for key, tensor in trained.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    original = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    assert [key for key in trained if torch.equal(trained[key], original[key])] == []  # training changed them all


@pytest.mark.slow  # Trainer, SFTTrainer and accelerate on 4 ranks
@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("trainer,layout", CASES)
def test_trained_model_merges_bit_exact(trained, source, trainer, layout):
    _, saved, trained_file = trained[trainer, layout]
    check_saved(saved, trained_file, source[0] / f"{trainer}-{layout}-merged", source[1])


# ---- accelerate's FSDP launch -------------------------------------------------------------------------------------

def accelerate_launch(nproc: int, script, *args, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`accelerate launch --use_fsdp --fsdp_version 2` of `script` on `nproc` CPU processes (accelerate starts them
    with torchrun; `--cpu` would start one), killed whole at `timeout`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
           "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--monitor_interval", "0.5", str(script), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                 "TOKENIZERS_PARALLELISM": "false", **env})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"accelerate launch did not finish within {timeout} s (hang?)\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.mark.slow  # Trainer, SFTTrainer and accelerate on 4 ranks
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_accelerate_fsdp_launch_with_ram_efficient_loading(source):
    """accelerate's defaults (FSDP_CPU_RAM_EFFICIENT_LOADING true): rank 1 loads its own bytes and trains."""
    root, src, corpus = source
    folder, saved, trained_file = root / "accelerate-ep2", root / "accelerate-saved", root / "accelerate.safetensors"
    write_checkpoint(src, folder, MeshSpec(fsdp=2, ep=2), progress=False)
    reports = root / "accelerate-reports"
    reports.mkdir()
    home = root / "hf-home"  # no accelerate config of this machine's user: the flags alone
    result = accelerate_launch(2, RANK_SCRIPTS / "trainers.py", reports, STEPS, corpus, "trainer", folder, saved,
                               trained_file, env={"HF_HOME": str(home)}, timeout=420)
    (root / "accelerate.log").write_text(result.stdout)
    errors = [json.loads(p.read_text()).get("error") for p in sorted(reports.glob("rank*.json"))]
    assert result.returncode == 0, f"rank errors: {errors}\n{result.stdout[-6000:]}"
    ranks = reports_of(reports, 2)[0]["cases"][0]
    check_training(ranks, 2, ram_efficient=True)
    check_saved(saved, trained_file, root / "accelerate-merged", src)


def test_meta_destinations_are_refused(source):
    """A load into a model still on meta (what transformers' RAM-efficient branch leaves on ranks other than 0) is a
    LoadError, not a silent no-op: DCP would load into copies of its own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.errors import LoadError
    from reshard.load._storage import load_model_state
    from reshard import read_manifest
    from reshard.read import LocalStore

    root, src, _ = source
    folder = root / "one-rank"
    write_checkpoint(src, folder, MeshSpec(fsdp=1), progress=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with pytest.raises(LoadError, match="still on the meta device"):
        load_model_state(model, read_manifest(folder), LocalStore(folder))
    model.to_empty(device="cpu")  # real destinations load, and equal the source
    load_model_state(model, read_manifest(folder), LocalStore(folder))
    state, reference = model.state_dict(), AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    assert state.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(state[key], tensor), key
