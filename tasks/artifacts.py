"""Prefect artifact keys: scoped to the run, so two recipes never share one artifact's history."""

from __future__ import annotations

import re


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes only) from free-form names."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower())).strip("-")
