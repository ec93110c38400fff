"""Tiny float32 Hugging Face causal LMs and the documented eager loop of
graph_train_step, shared by tests/train/test_cuda_train_step_hf_fp32.py and
benchmarks/probes/fp32_bitwise.py (which measure the same thing). Built from config, no downloads,
dropout off (a captured dropout draws other masks than eager, which is documented).

Every family but ``llama_mha`` and GPT-2 has fewer key/value heads than query heads
(grouped-query attention, :data:`GQA_FAMILIES`): that is where an explicit mask makes
transformers repeat the keys and SDPA run another kernel (docs/train-step.md).
"""

import copy

import torch

from cudagraphs.train import prepare_optimizer

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 4, 2, 2, 128
BATCH, SEQ, STEPS, LR = 2, 64, 8, 1e-3

_TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
_GQA = dict(
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    vocab_size=VOCAB,
    max_position_embeddings=4 * SEQ,
)
# family -> (transformers model type, config, experts implementation)
FAMILIES = {
    "llama": ("llama", _GQA, None),
    "llama_mha": ("llama", dict(_GQA, num_key_value_heads=HEADS), None),
    "qwen2": ("qwen2", _GQA, None),
    "phi3": ("phi3", dict(_GQA, **_TOKENS), None),
    "gemma2": ("gemma2", dict(_GQA, head_dim=HIDDEN // HEADS), None),
    # Its sliding layers attend to 32 of the 64 positions: a mask eagerly too.
    "gemma2_window32": ("gemma2", dict(_GQA, head_dim=HIDDEN // HEADS, sliding_window=32), None),
    "olmoe": (
        "olmoe",
        dict(_GQA, num_experts=4, num_experts_per_tok=2, **_TOKENS),
        "batched_mm",
    ),
    "gpt2": (
        "gpt2",
        dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=4 * SEQ, vocab_size=VOCAB),
        None,
    ),
}
# The families whose attention has fewer key/value heads than query heads.
GQA_FAMILIES = ("llama", "qwen2", "phi3", "gemma2", "gemma2_window32", "olmoe")


def build(family, device="cuda", seed=0):
    """A fresh float32 model of ``family`` in train mode, weights from ``seed``."""
    import transformers

    model_type, kwargs, experts = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model.to(device).train()


def batches(n=STEPS, seed=3, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(2, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(n)]


def step_for(model, **call):
    """``step_fn`` of graph_train_step: the model's own causal-LM loss, then backward.
    ``call`` goes to the model (``use_cache=False``, ``attention_mask=...``)."""

    def step(ids):
        loss = model(input_ids=ids, labels=ids, **call).loss
        loss.backward()
        return loss

    return step


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


def eager_loop(model, batches_, **call):
    """The documented eager equivalent of graph_train_step, from the model as it is;
    returns the losses."""
    opt = make_optimizer(model)
    prepare_optimizer(opt)
    step, losses = step_for(model, **call), []
    for ids in batches_:
        for p in model.parameters():
            p.grad = None
        losses.append(step(ids).detach())
        opt.step()
    return losses


def graphed_loop(model, batches_, **call):
    """graph_train_step from the model as it is, run over ``batches_``. Returns the step,
    the losses and how many model forwards ran in Python during the loop (0: every
    step replayed)."""
    import cudagraphs

    step = cudagraphs.graph_train_step(
        step_for(model, **call), batches_[0], optimizer=make_optimizer(model)
    )
    forwards = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        losses = [step(ids).clone() for ids in batches_]
    finally:
        handle.remove()
    return step, losses, len(forwards)


def copies(family, n, device="cuda"):
    """``n`` models of ``family`` with the same weights."""
    first = build(family, device)
    return [first] + [copy.deepcopy(first) for _ in range(n - 1)]


def max_param_diff(a, b):
    """The largest absolute difference between the parameters of two models."""
    return max(
        (p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters())
    )


def max_loss_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))
