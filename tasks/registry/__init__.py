"""The MLflow model registry: versions, their aliases and records, and the champion's promotion.

register.py          an evaluated checkpoint registered as an MLflow Model version, its aliases moved
aliases.py           the registry's aliases: tessera's moves, their record, the moves made elsewhere
version_record.py    what the registry knows of a version beyond its tags: a record and its decision history
promote.py           champion against challenger on fresh scores, moved by the rule
promote_rule.py      the rule: is the challenger's gain real, by the recipe's `promote` section
promote_lock.py      one move of a model's champion at a time, whoever makes it
promote_config.py    the recipe's `promote` section
"""
