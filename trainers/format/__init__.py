"""The checkpoint format: what a training run leaves behind and how anyone else reads it.

trainers/ writes checkpoints; evaluation/, tasks/ and the trainer's own resume read them. This
package is all they share: the manifest contract (`checkpoints`: CheckpointInfo, publish,
list_complete, the SHA-256 and zip checks), the one durable way to write a state file (`atomic`),
the meta-device build a load uses (`meta`), the export to a plain `transformers` model (`export`)
and to an MLflow Model (`mlflow_model`). It imports nothing else of tessera, so reading a
checkpoint never pulls in the trainer, Composer's launcher or Prefect.

It is a subpackage of trainers/ rather than a package of its own to keep the project's top level
what docs/DESIGN names (flows, tasks, trainers, evaluation, infra); tests/test_structure.py holds
it to importing nothing of trainers/ outside it.
"""
