"""Models whose answers are known in advance, and small task files, for tests and benchmarks of the gauntlet.

`bigram_model` is a transformers causal LM whose logits at a position depend only on the
token there, through a table you write: `prefer={"is": "blue"}` makes "blue" the argmax
after "is" with logit `strength`; every other logit is 0. Hand-computing an expected
accuracy then needs only that table. `word_tokenizer` maps whitespace-separated words to
ids, so a test reads in words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast
from transformers.modeling_outputs import CausalLMOutputWithPast

SPECIALS = ["<pad>", "<eos>", "<unk>"]

# The files configs/gauntlet/tiny_tasks.yaml names, relative to a data root's eval/local_data/.
DEMO_TASK_FILES = (
    "language_understanding/lambada_openai_small.jsonl",
    "commonsense_reasoning/copa.jsonl",
    "language_understanding/winograd_wsc.jsonl",
)


def cut_demo_tasks(source: Path, root: Path, records: int = 12) -> Path:
    """A data root for tiny_tasks.yaml holding the first `records` records of each file under `source`
    (a data root's eval/local_data), so a whole gauntlet scores in about a second."""
    for rel in DEMO_TASK_FILES:
        dest = root / "eval" / "local_data" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("\n".join((source / rel).read_text().split("\n")[:records]) + "\n")
    return root


def word_tokenizer(words: Iterable[str]) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate([*SPECIALS, *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


class BigramConfig(PretrainedConfig):
    model_type = "tessera_bigram"

    def __init__(self, vocab_size: int = 8, max_position_embeddings: int = 512, **kwargs: Any):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


class BigramLM(PreTrainedModel, GenerationMixin):
    """logits[b, t] = table[input_ids[b, t]]; ignores attention and cache, which a bigram does not need."""

    config_class = BigramConfig

    def __init__(self, config: BigramConfig):
        super().__init__(config)
        self.table = nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size), requires_grad=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        logits = self.table[input_ids]  # [B, T, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask")}

    def _supports_default_dynamic_cache(self) -> bool:  # no cache: every step re-reads the last token
        return False


def bigram_model(tokenizer: Any, prefer: dict[str, str], strength: float = 5.0) -> BigramLM:
    vocab = tokenizer.get_vocab()
    model = BigramLM(BigramConfig(vocab_size=len(vocab), pad_token_id=tokenizer.pad_token_id))
    with torch.no_grad():
        for src, dst in prefer.items():
            model.table[vocab[src], vocab[dst]] = strength
    return model.eval()


def bigram_nll(vocab_size: int, strength: float, preferred: bool) -> float:
    """Cross-entropy of one token under a bigram row: the closed form tests compare against."""
    log_z = math.log(math.exp(strength) + vocab_size - 1)
    return log_z - (strength if preferred else 0.0)


def fitted_bigram(tokenizer: Any, texts: Iterable[str], alpha: float = 0.1) -> BigramLM:
    """A bigram LM trained on `texts`: logits = log P(next | token), add-`alpha` smoothed counts of the
    consecutive token pairs in the texts (each text tokenized on its own)."""
    vocab = tokenizer.get_vocab()
    counts = torch.zeros(len(vocab), len(vocab))
    for text in texts:
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        if len(ids) > 1:
            counts.index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1), accumulate=True)
    model = BigramLM(BigramConfig(vocab_size=len(vocab), pad_token_id=tokenizer.pad_token_id))
    with torch.no_grad():
        smoothed = counts + alpha
        model.table.copy_(torch.log(smoothed / smoothed.sum(dim=1, keepdim=True)))
    return model.eval()


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 64, positions: int = 128):
    """A real transformers Llama small enough to score a gauntlet in seconds, the same weights for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()
