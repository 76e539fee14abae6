"""The analysed requests' phases as the product's readers get them: figures joined with their split."""

from __future__ import annotations

from tokenprobe.contract.figures import DEFAULT_DEFINITION, phases_select


def phases_of(store, condition: str = "1", definition: str = DEFAULT_DEFINITION) -> str:
    """A subquery of the phases (``REQUEST_PHASES_COLUMNS``) of the requests that have a split and meet
    ``condition``, their figures computed by ``definition``."""
    select = phases_select(store.table("request_figures"), store.table("request_split"), condition, definition)
    return f"({select} WHERE computed_at > 0)"
