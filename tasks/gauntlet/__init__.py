"""Scoring checkpoints on the gauntlet: while a run trains, and outside one. It knows nothing of the registry: the
queue that chains a checkpoint's evaluation and registration is the training stage's (tasks/training/gauntlet_queue.py).

evaluate.py          one checkpoint scored, logged to the training run, a markdown artifact left
score.py             a model scored outside training: `tessera eval`, `compare`, promotion
"""
