"""The checkpoint format: what a training run leaves behind and how anyone else reads it.

trainers/ writes checkpoints; evaluation/, tasks/ and the trainer's own resume read them. This package is all they
share, and it imports nothing else of tessera, so reading a checkpoint never pulls in the trainer, Composer's
launcher or Prefect. A subpackage of trainers/ rather than a package of its own, to keep the top level the five
packages docs/ARCHITECTURE.md draws; tests/test_structure.py holds it to importing nothing of trainers/ outside it.

checkpoints.py   the manifest contract: CheckpointInfo, publish, list_complete, the SHA-256 and zip checks
store.py         one run's checkpoints on disk or in its s3 mirror, read one way: list, pin, read, retire, publish
s3.py            object storage: its client, its one error, and folders published to and fetched from a bucket
atomic.py        the one durable way to write a state file, and a journal's append
safe_load.py     reading a checkpoint without running code it carries
sharded.py       reading a sharded (DCP) checkpoint folder in one process
meta.py          the meta-device build a load uses
export.py        a Composer checkpoint as a plain Hugging Face model directory
model_dirs.py    reading a model directory (Hugging Face, or an MLflow Model of one) without running its code
mlflow_model.py  a checkpoint as an MLflow Model (transformers flavor), without Prefect
"""
