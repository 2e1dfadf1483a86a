"""The training loss without the logits: a chunked, fused linear cross-entropy.

The head's logits are the largest tensor of a step. At 350M, a microbatch of 16 x 2048 tokens over a
50,304-wide head is 3.3 GB in bf16, and transformers' loss upcasts it to a 6.6 GB fp32 copy; autograd
keeps them alive through the backward. Here the head and the loss are one autograd Function that walks
the tokens in chunks: each chunk's logits are made, turned into the loss and into their gradient
(softmax minus the one-hot target), multiplied back into the gradients of the hidden states and of the
head's weight, and freed. What the backward keeps is those two gradients ([N, D] and [V, D]), so the peak
holds one chunk's logits, never the microbatch's (Liger-Kernel's FusedLinearCrossEntropy does the same in
Triton; this is plain torch, so it runs and is tested on CPU, and inductor fuses the chunk's elementwise
work when the trainer compiles).

Only training uses it: held-out evaluation and the gauntlet keep the model's own logits and exact scoring.
The loss is transformers' ForCausalLMLoss: position t predicts token t+1, targets of -100 are ignored, the
mean is over the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

IGNORE = -100
CHUNK_BYTES = 1 << 30  # fp32 logits made at a time: big enough for full-speed matmuls, small next to a step


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d loss_sum / d logits) of one chunk, in fp32; an ignored target's row is all zeros."""
    x = logits.float()
    valid = targets != IGNORE
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    grad = torch.exp(x - lse[:, None])  # softmax
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(grad[:, :1]))
    return loss, grad * valid[:, None]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows: int, step: Callable):
        # hidden [N, D], weight [V, D], targets [N]. Under autocast the matmuls run in its dtype, as F.linear's do.
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device_type, enabled=False):
            for s in range(0, h.shape[0], chunk_rows):
                hc = h[s : s + chunk_rows]
                loss, grad = step(hc @ w.T, targets[s : s + chunk_rows])
                total += loss
                g = grad.to(dtype)
                grad_hidden[s : s + chunk_rows] = g @ w
                grad_weight += (g.T @ hc).float()  # each chunk's in the matmul's dtype, summed in fp32
        count = (targets != IGNORE).sum().clamp(min=1)
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_out / count
        hidden_dtype, weight_dtype = ctx.dtypes
        return (grad_hidden * scale).to(hidden_dtype), (grad_weight * scale).to(weight_dtype), None, None, None


def chunk_rows_for(vocab: int, rows: int) -> int:
    """Tokens per chunk: CHUNK_BYTES of fp32 logits, and chunks of equal size where possible (a compiled step
    then sees one shape)."""
    most = max(1, CHUNK_BYTES // (4 * vocab))
    chunks = -(-rows // most)
    return -(-rows // chunks)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, step: Callable | None = None
) -> torch.Tensor:
    """mean over targets != -100 of cross_entropy(hidden @ weight.T, targets), without the logits of every row
    at once. `step` is `_chunk_loss_and_grad`, or a compiled copy of it."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = chunk_rows_for(weight.shape[0], flat.shape[0])
    return _LinearCrossEntropy.apply(flat, weight, targets.reshape(-1), rows, step or _chunk_loss_and_grad)


def use_fused_loss(model: torch.nn.Module, guard=None) -> None:
    """Give the HF causal LM `model` a training forward that returns the loss from linear_cross_entropy and no
    logits; in eval mode, or without labels, it is the model's own forward.

    The forward is replaced on the instance, not around the module: hooks on the module (FSDP2's unit that
    gathers the embeddings, the final norm and the head) run around it as around the original, and the
    state dict does not change. `guard` (trainers/compile.Guard): the per-chunk loss is compiled with the blocks,
    behind the same guard; none: eager."""
    original = model.forward
    step = guard.wrap(_chunk_loss_and_grad, dynamic=False) if guard is not None else _chunk_loss_and_grad

    def forward(input_ids=None, attention_mask=None, labels=None, **kwargs):
        if not model.training or labels is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
        head = model.get_output_embeddings().weight
        loss = linear_cross_entropy(out.last_hidden_state[:, :-1], head, labels[:, 1:], step)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = forward
