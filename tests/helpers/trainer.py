"""A small transformers.Trainer run on tiny models, shared by the Trainer integration
tests on the CPU and on the GPU (imports transformers only when called)."""

import torch


class Backend:
    """An eager capture backend: each recorded call becomes its adapter, run eagerly."""

    def __init__(self):
        self.captures = 0

    def __call__(self, callables, sample_args, sample_kwargs):
        self.captures += 1
        return list(callables)


def dataset(n=40, seq=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n, seq), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def train(
    tmp_path,
    model,
    callbacks=(),
    *,
    steps=10,
    accumulation=2,
    eval_steps=None,
    use_cpu=True,
    **extra,
):
    """A Trainer run of ``steps`` optimizer steps on a fixed random dataset, logging
    every step (and evaluating every ``eval_steps``); returns the trainer."""
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=use_cpu,
        report_to=[],
        max_steps=steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset(8, seed=1) if eval_steps else None,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


def losses(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h]
