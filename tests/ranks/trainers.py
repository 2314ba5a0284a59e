"""Rank script: real trainers on a reshard folder, then transformers' distributed save.

usage: trainers.py REPORT_DIR STEPS CORPUS (TRAINER FOLDER SAVE_DIR TRAINED_FILE)...
TRAINER: `trainer` (transformers' `Trainer`) or `sft` (TRL's `SFTTrainer`). CORPUS: a text file, one training
sentence a line, all of the same length in tokens (no padding needed).

Per case: `reshard.from_pretrained(FOLDER)` and the tokenizer `reshard write` copied into FOLDER, STEPS optimizer
steps of TRAINER on CORPUS (each rank gets its share of every batch; a step covers the corpus), then
`save_pretrained(SAVE_DIR, distributed_checkpoint=True)`; rank 0 writes every tensor's `full_tensor()` (the trained
model, gathered) to TRAINED_FILE. Besides the trainer's logged losses, every rank computes the loss of one fixed
batch before and after training on its own: all ranks must find the same numbers. Runs under torchrun or
`accelerate launch`. Each rank writes REPORT_DIR/rank{r}.json (`error` with the traceback on failure, else `cases`:
per case what every rank found) and exits non-zero on error.
"""

import os
import sys

import torch
import torch.distributed as dist

from rank_report import finish, record_failure, save


def full_state(model) -> dict:
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in model.state_dict().items()}


def fixed_batch_loss(model, tokenizer, sentences) -> float:
    """The loss of the first two sentences, computed by this rank alone (FSDP gathers the weights)."""
    from torch.distributed.fsdp import FSDPModule

    ids = tokenizer(sentences[:2], return_tensors="pt")["input_ids"]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    model.train(was_training)
    # The modules transformers shards with reshard_after_forward=False (the final norm, lm_head) keep their full
    # weights after a forward; an optimizer created then would step those, which FSDP drops: transformers 5.24's
    # Trainer reshards before creating its optimizer, 5.23's does not (norm and lm_head would never train).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return loss


def common_args(out_dir, steps, sentences) -> dict:
    # `use_cpu`: accelerate runs a torchrun job as MULTI_CPU (each rank its share of every batch) only when asked for
    # the CPU; without it, it sees no distributed setup and every rank trains on the whole batch. Reporting off, no
    # dataloader workers, a batch that is the whole corpus; no checkpoints during training (the trainer cannot save
    # the optimizer state of a model sharded at load time): the model is saved after training.
    return dict(output_dir=out_dir, use_cpu=True, max_steps=steps,
                per_device_train_batch_size=len(sentences) // dist.get_world_size(), learning_rate=5e-3,
                lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[],
                dataloader_num_workers=0, disable_tqdm=True, seed=0)


def train_trainer(model, tokenizer, sentences, out_dir, steps):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = tokenizer(sentences)["input_ids"]
    dataset = Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = Trainer(model=model, args=TrainingArguments(**common_args(out_dir, steps, sentences)),
                      train_dataset=dataset)
    trainer.train()
    return trainer


def train_sft(model, tokenizer, sentences, out_dir, steps):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(**common_args(out_dir, steps, sentences), max_length=16, packing=False)
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": sentences}))
    trainer.train()
    return trainer


TRAINERS = {"trainer": train_trainer, "sft": train_sft}


def run_case(rank, steps, sentences, kind, folder, save_dir, trained_file, report):
    import reshard
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from transformers.distributed.fsdp import is_fsdp_enabled

    model = reshard.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    before = fixed_batch_loss(model, tokenizer, sentences)
    trainer = TRAINERS[kind](model, tokenizer, sentences, save_dir + "-run", steps)
    # `ram_efficient_loading`: accelerate's FSDP_CPU_RAM_EFFICIENT_LOADING as transformers' loading saw it
    seen = {"logged": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "before": before, "after": fixed_batch_loss(model, tokenizer, sentences),
            "distributed_type": str(trainer.accelerator.distributed_type), "ram_efficient_loading": is_fsdp_enabled()}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, seen)
    report.setdefault("cases", []).append({"trainer": kind, "folder": folder, "ranks": ranks})
    trained = full_state(model)
    model.save_pretrained(save_dir, distributed_checkpoint=True)
    if rank == 0:
        save_file({n: t.contiguous() for n, t in trained.items()}, trained_file)
    dist.barrier()


def main():
    report_dir, steps, corpus, *args = sys.argv[1:]
    with open(corpus) as f:
        sentences = f.read().splitlines()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"rank": rank}
    try:
        for i in range(0, len(args), 4):
            run_case(rank, int(steps), sentences, *args[i:i + 4], report)
    except BaseException as e:  # report everything: the test asserts on it
        record_failure(report, e)
        save(report_dir, report)
        os._exit(3)
    finish(report_dir, report)


if __name__ == "__main__":
    main()
