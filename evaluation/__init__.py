"""The eval gauntlet: Mosaic Eval Gauntlet files in, llm-foundry's scoring, reports out.

Never imports Prefect: it runs inside pods too. Import the module you need (reading the `eval` recipe
section, evaluation/config.py, imports no torch).

__main__.py       the evaluation pod's entrypoint: `python -m evaluation --checkpoint ...`
protocol.py       what the pod and the flow agree on: its summary line and exit codes
config.py         the recipe's `eval` section: when and what the gauntlet runs
spec.py           the Gauntlet's own YAML files, read unchanged into typed specs
sources.py        where gauntlet files come from (local or s3://), jsonl with line numbers
prompts.py        records -> prompts -> token ids, as llm-foundry's ICL datasets build them
batching.py       which rows share a batch, their padding, and the positions scored
scoring.py        continuations scored by cross-entropy: language_modeling, multiple_choice, schema
generation.py     generation_task_with_answers: greedy continuations against the answer aliases
runner.py         run_gauntlet: task list, gauntlet, model and tokenizer in; a GauntletReport out
models.py         what `--model M` names, loaded as a transformers model and tokenizer
aggregate.py      benchmark scores -> category scores -> named averages
report.py         a GauntletReport and its renderings: metrics, markdown, table rows, JSON
html.py           a self-contained HTML report with a PNG of scores against tokens
compare.py        two reports side by side: deltas, a plot and an HTML page
noise.py          how much of a difference is noise: a paired bootstrap over the examples
identity.py       which gauntlet a score came from: a hash of all that decides the numbers
mlflow_report.py  a GauntletReport on an MLflow run: metrics at step = tokens, a table, JSON, HTML
progress.py       a gauntlet run's progress: a bar on a terminal, a line at most every `every_s`
errors.py         GauntletError, the one error for bad gauntlet input (a OneLineError)
"""
