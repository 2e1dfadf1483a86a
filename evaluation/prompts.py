"""Records -> prompts -> token ids, the way llm-foundry's ICL datasets build them.

Reference: llmfoundry/eval/datasets/in_context_learning_evaluation.py and utils.py. Details
that move scores and are reproduced on purpose:
- every top-level string field is stripped; the test context is rstripped;
- the few-shot preamble is tokenized with special tokens (a trailing EOS dropped), the test
  context without, and the two token lists are concatenated (not the strings);
- the answer gets a leading space when the tokenizer encodes ' a' as one token (BPE);
  few-shot answers inside the preamble do not;
- schema tasks put `continuation_delimiter` (rstripped) after each context option only when
  a preamble precedes it;
- contexts are left-truncated so context + continuation fits `max_seq_len`;
- few-shot indices come from one `random.Random(seed)` advanced over the examples in order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from evaluation.errors import GauntletError
from evaluation.spec import TaskSpec

# Allow a chain-of-thought answer a few more tokens than the longest one in the file (reference value).
MAX_ANSWER_BUFFER = 10

REQUIRED_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "language_modeling": {"context": str, "continuation": str},
    "multiple_choice": {"query": str, "choices": list, "gold": int},
    "schema": {"context_options": list, "continuation": str, "gold": int},
    "generation_task_with_answers": {"context": str, "answer": str},
}
OPTIONAL_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "generation_task_with_answers": {"aliases": list, "chain_of_thought": str},
}


@dataclass(frozen=True)
class Record:
    lineno: int
    data: dict[str, Any]


@dataclass
class ChoiceItem:
    """One scored example: a row of token ids per choice; the continuation is the row's tail."""

    rows: list[list[int]]
    cont_lens: list[int]
    gold: int
    # Leading tokens every row shares (the context of a multiple-choice example, the few-shot
    # preamble of a schema one); 0 when there is nothing to share or truncation broke it.
    prefix: int = 0


@dataclass
class GenerationItem:
    context: list[int]
    answers: list[str]


@dataclass
class PreparedSplit:
    """All examples of one (task, num_fewshot, category) ready for the model."""

    label: str
    num_fewshot: int
    category: str | None
    kind: str
    choice_items: list[ChoiceItem] = field(default_factory=list)
    generation_items: list[GenerationItem] = field(default_factory=list)
    max_new_tokens: int = 1

    def __len__(self) -> int:
        return len(self.choice_items) or len(self.generation_items)


def validate_records(task: TaskSpec, uri: str, records: Sequence[tuple[int, dict]]) -> list[Record]:
    """Check field names and types; errors name the task, the file, the line and the field."""
    required = dict(REQUIRED_FIELDS[task.icl_task_type])
    if task.has_categories:
        required["category"] = str
    optional = OPTIONAL_FIELDS.get(task.icl_task_type, {})
    out = []
    for lineno, data in records:
        where = f"task '{task.label}': {uri}:{lineno}"
        for name, typ in required.items():
            if name not in data:
                raise GauntletError(
                    f"{where}: missing field '{name}' ({task.icl_task_type} records need {', '.join(required)};"
                    f" found {', '.join(sorted(data)) or 'nothing'})"
                )
            if not isinstance(data[name], typ) or (typ is int and isinstance(data[name], bool)):
                raise GauntletError(f"{where}: field '{name}' must be {typ.__name__}, got {type(data[name]).__name__}")
        for name, typ in optional.items():
            if name in data and not isinstance(data[name], typ):
                raise GauntletError(f"{where}: field '{name}' must be {typ.__name__}, got {type(data[name]).__name__}")
        options = data.get("choices", data.get("context_options"))
        if task.icl_task_type in ("multiple_choice", "schema"):
            name = "choices" if task.icl_task_type == "multiple_choice" else "context_options"
            if not options or not all(isinstance(o, str) for o in options):
                raise GauntletError(f"{where}: field '{name}' must be a non-empty list of strings")
            if not 0 <= data["gold"] < len(options):
                raise GauntletError(f"{where}: field 'gold' is {data['gold']}, outside 0..{len(options) - 1}")
        # llm-foundry strips surrounding whitespace from every top-level string (strip_dataset=True).
        out.append(Record(lineno, {k: v.strip() if isinstance(v, str) else v for k, v in data.items()}))
    return out


def fewshot_indices(dataset_size: int, num_fewshot: int, example_idx: int, rng: random.Random) -> set[int]:
    """llm-foundry's get_fewshot_sample_idxs: sample without replacement, never the example itself.

    Returned as a set and iterated as one, because the reference orders few-shot examples by
    Python's set iteration order; the same interpreter gives the same prompt.
    """
    num_fewshot = min(dataset_size - 1, num_fewshot)
    idxs = set(rng.sample(range(0, dataset_size), num_fewshot))
    if example_idx in idxs:
        idxs.remove(example_idx)
        if len(idxs) >= dataset_size - 1:
            return idxs
        replacement = rng.choice(range(0, dataset_size))
        while replacement in idxs or replacement == example_idx:
            replacement = rng.choice(range(0, dataset_size))
        idxs.add(replacement)
    return idxs


class _Builder:
    """Prompt strings for one task type (reference: construct_context and friends)."""

    def __init__(self, task: TaskSpec, has_cot: bool):
        self.t = task
        self.has_cot = has_cot

    def answer(self, r: dict) -> str:
        kind = self.t.icl_task_type
        if kind == "language_modeling":
            return r["continuation"]
        if kind == "multiple_choice":
            return r["choices"][r["gold"]]
        if self.has_cot:
            return f"{r.get('chain_of_thought', '')}{self.t.cot_delimiter}{r['answer']}"
        return r["answer"]

    def shot(self, r: dict, preceding: str) -> str:
        """A solved example for the few-shot preamble."""
        t = self.t
        if t.icl_task_type == "schema":
            ctx = r["context_options"][r["gold"]]
            if preceding:
                ctx = f"{t.example_delimiter}{ctx}"
            return f"{t.question_prelimiter}{ctx}{t.continuation_delimiter}{r['continuation']}"
        return self.context(r, preceding) + self.answer(r)

    def context(self, r: dict, preceding: str) -> str:
        t = self.t
        key = "query" if t.icl_task_type == "multiple_choice" else "context"
        ctx = f"{t.question_prelimiter}{r[key]}"
        if preceding:
            ctx = f"{t.example_delimiter}{ctx}"
        return f"{ctx}{t.continuation_delimiter}"

    def schema_contexts(self, r: dict, preceding: str) -> list[str]:
        t = self.t
        if preceding:
            delim = t.continuation_delimiter.rstrip()
            return [f"{t.question_prelimiter}{t.example_delimiter}{c}{delim}" for c in r["context_options"]]
        return [f"{t.question_prelimiter}{c}" for c in r["context_options"]]

    def preamble(self, records: Sequence[Record], idx: int, num_fewshot: int, rng: random.Random) -> str:
        text = self.t.prompt_string
        if num_fewshot > 0:
            for j in fewshot_indices(len(records), num_fewshot, idx, rng):
                text += self.shot(records[j].data, text)
        return text


class _Tokens:
    """Batched tokenization with the reference's special-token rules."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.prefix_space = len(tokenizer(" a", add_special_tokens=False)["input_ids"]) == 1

    def preambles(self, texts: list[str]) -> list[list[int]]:
        eos = self.tok.eos_token_id
        out = []
        for ids in self._encode(texts, special=True):
            # An empty preamble may still carry BOS/EOS; an EOS would sit mid-prompt.
            if eos is not None and len(ids) > 1 and ids[-1] == eos:
                ids = ids[:-1]
            out.append(ids)
        return out

    def plain(self, texts: list[str]) -> list[list[int]]:
        return self._encode(texts, special=False)

    def with_special(self, texts: list[str]) -> list[list[int]]:
        return self._encode(texts, special=True)

    def _encode(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        return [list(x) for x in self.tok(list(texts), add_special_tokens=special)["input_ids"]]


def _trim(context: list[int], cont_len: int, max_len: int, where: str) -> list[int]:
    if cont_len + len(context) <= max_len:
        return context
    keep = max_len - cont_len
    if keep < 1:
        raise GauntletError(f"{where}: continuation of {cont_len} tokens does not fit max_seq_len {max_len}")
    return context[-keep:]


@dataclass(frozen=True)
class PromptText:
    """The strings of one example, before tokenization: what the model is shown, per choice."""

    preamble: str  # prompt_string + solved few-shot examples
    contexts: tuple[str, ...]  # per choice (repeated for multiple_choice); one for LM and generation
    continuations: tuple[str, ...]  # per choice; empty for generation


def prompt_texts(
    task: TaskSpec, records: Sequence[Record], num_fewshot: int, seed: int, prefix_space: bool
) -> list[PromptText]:
    kind = task.icl_task_type
    has_cot = kind == "generation_task_with_answers" and any("chain_of_thought" in r.data for r in records)
    b = _Builder(task, has_cot)
    rng = random.Random(seed)

    def spaced(text: str) -> str:
        return f" {text}" if prefix_space and not text.startswith(" ") else text

    out = []
    for i, r in enumerate(records):
        pre = b.preamble(records, i, num_fewshot, rng)
        if kind == "schema":
            ctxs = tuple(b.schema_contexts(r.data, pre))
            conts = tuple(spaced(r.data["continuation"]) for _ in ctxs)
        elif kind == "multiple_choice":
            ctx = b.context(r.data, pre).rstrip()
            conts = tuple(spaced(c) for c in r.data["choices"])
            ctxs = tuple(ctx for _ in conts)
        elif kind == "language_modeling":
            ctxs, conts = (b.context(r.data, pre).rstrip(),), (spaced(r.data["continuation"]),)
        else:
            ctxs, conts = (b.context(r.data, pre).rstrip(),), ()
        out.append(PromptText(pre, ctxs, conts))
    return out


def prepare_split(
    task: TaskSpec,
    uri: str,
    records: Sequence[Record],
    tokenizer: Any,
    num_fewshot: int,
    max_seq_len: int,
    seed: int,
    category: str | None = None,
) -> PreparedSplit:
    """Build every prompt of one split and tokenize it (preamble, context, continuation apart)."""
    kind = task.icl_task_type
    tk = _Tokens(tokenizer)
    texts = prompt_texts(task, records, num_fewshot, seed, tk.prefix_space)
    preambles = tk.preambles([p.preamble for p in texts])
    # A multiple-choice example repeats one context for every choice: tokenize it once.
    distinct = [p.contexts[:1] if kind == "multiple_choice" else p.contexts for p in texts]
    contexts = iter(tk.plain([c for cs in distinct for c in cs]))
    continuations = iter(tk.plain([c for p in texts for c in p.continuations]))
    split = PreparedSplit(task.label, num_fewshot, category, kind)

    if kind == "generation_task_with_answers":
        has_cot = any("chain_of_thought" in r.data for r in records)
        answers = [[r.data["answer"], *r.data.get("aliases", [])] for r in records]
        responses = [
            f"{r.data.get('chain_of_thought', '')}{task.cot_delimiter}{a}" if has_cot else a
            for r, alts in zip(records, answers)
            for a in alts
        ]
        longest = max((len(x) for x in tk.with_special(responses)), default=0)
        longest += MAX_ANSWER_BUFFER if task.cot_delimiter else 0
        budget = max(max_seq_len, longest) - longest  # room left for the context
        for r, pre, alts in zip(records, preambles, answers):
            full = pre + next(contexts)
            full = full[-budget:] if budget > 0 else []
            if not full:
                raise GauntletError(
                    f"task '{task.label}': {uri}:{r.lineno}: answers of {longest} tokens leave no room in "
                    f"max_seq_len {max_seq_len}"
                )
            split.generation_items.append(GenerationItem(full, list(dict.fromkeys(alts))))
        split.max_new_tokens = task.generation_kwargs.max_new_tokens or max(longest, 1)
        return split

    for r, pre, p in zip(records, preambles, texts):
        where = f"task '{task.label}': {uri}:{r.lineno}"
        rows, lens = [], []
        shared = pre + next(contexts) if kind == "multiple_choice" else None
        untrimmed = True
        for _ in p.continuations:
            ctx = shared if shared is not None else pre + next(contexts)
            cont = next(continuations)
            if not cont:
                raise GauntletError(f"{where}: continuation tokenizes to nothing")
            kept = _trim(ctx, len(cont), max_seq_len, where)
            untrimmed &= len(kept) == len(ctx)
            rows.append(kept + cont)
            lens.append(len(cont))
        prefix = 0
        if untrimmed and len(rows) > 1:
            prefix = len(shared) if shared is not None else len(pre)
        split.choice_items.append(ChoiceItem(rows, lens, int(r.data.get("gold", 0)), prefix))
    return split
