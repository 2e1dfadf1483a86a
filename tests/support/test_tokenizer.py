"""The small tokenizer the test recipes train with: a byte-level BPE of 4,096 ids over the demo's two corpora.

The demo's GPT-NeoX tokenizer has 50,277 ids; at d_model 64 its embedding and head are 94% of the
tiny model's parameters, and projecting every position onto them is most of a training step (0.87 s
against 0.07 s at 4,096 ids, one thread) and of a checkpoint (42.6 MB against 3.9 MB). Tests of the
pipeline's machinery (resume, cancel, outages, registration) need a model, not that vocabulary; the
demo and the tokenizer tests keep GPT-NeoX. Same special tokens as GPT-NeoX: <|endoftext|> = 0,
<|padding|> = 1.

Regenerate the committed file with `python -m tests.support.test_tokenizer` (deterministic for a
given `tokenizers` version).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = ROOT / "tests" / "fixtures" / "tokenizer-4k" / "tokenizer.json"
VOCAB = 4096
CORPORA = (
    ROOT / "data" / "corpora" / "tinyshakespeare" / "input.txt",
    ROOT / "data" / "corpora" / "tinystories" / "tinystories_val.txt",
)


def build() -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p for path in CORPORA for p in path.read_text().split("\n\n")]
    bpe.train_from_iterator(texts, trainer)
    PATH.parent.mkdir(parents=True, exist_ok=True)
    bpe.save(str(PATH))
    return PATH


if __name__ == "__main__":
    print(build())
