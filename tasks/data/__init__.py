"""The prepare stage's data handling, free of Prefect (tasks/prepare.py and flows/prepare.py wrap it).

config     the recipe's `data` section (sources are a union on `kind`)
storage    listing, fingerprinting and reading local and s3:// files
units      sources -> work units (files, byte ranges, row groups) -> jobs
partitions  units -> partitions cut from the data alone; an output's layout, each partition's record and marker
readers    a work unit -> document strings, per format
pieces     byte ranges -> the pieces between separators, bounded by max_doc_chars
tally      bad input -> DataError or a counted skip; what was filtered or truncated
tokenizer  load or train the tokenizer, saved with the data (TokenizerInfo)
worker     tokenize one job of units in a pool process (no Streaming import there)
parallel   the shared spawn-based process pool
packing    ids -> fixed seq_len windows
mds        windows -> MDSWriter shards
hashing    what the output hash covers
outputs    staged directories, provenance.json, the done-marker
partition_run  partitions through the pool: each packed, written and marked done on its own
merge      every partition done -> the splits' merged index.json, provenance, then the output's _DONE
spec       an output's plan file (plan.json) and a prepare Job's index file: what a pod needs
pipeline   one source end to end: plan, partitions, merge, publish (prepare_source)
cluster    every source's partitions left as one Indexed Job of CPU pods; followed, merged, published
pod        one index of that Job: one partition into the s3 data root (python -m tasks.data.pod)
results    PreparedSource / PreparedData / RecipeData and `summarize`
errors     DataError: one line naming the file and line or field
claim      one writer per output directory, across processes and hosts sharing the data root
interrupt  what a signal does to the prepare stage: stop, publish nothing partial, exit in bounded time
remote_root  an s3:// data root: prepared in a local working copy, then published to the bucket
home       where an output lasts, what training reads: the local folder or its s3:// copy (one choice)
"""

from tasks.data.config import DataConfig

__all__ = ["DataConfig"]
