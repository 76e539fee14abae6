"""The analysed requests' phases as the product's readers get them (figures joined with their split), and
a store's analyses forgotten."""

from __future__ import annotations

from tokenprobe.contract.figures import DEFAULT_DEFINITION, phases_select


def phases_of(store, condition: str = "1", definition: str = DEFAULT_DEFINITION) -> str:
    """A subquery of the phases (``REQUEST_PHASES_COLUMNS``) of the requests that have a split and meet
    ``condition``, their figures computed by ``definition``."""
    select = phases_select(store.table("request_figures"), store.table("request_split"), condition, definition)
    return f"({select})"


ANALYSIS_TABLES = ("request_split", "prefill_calibration", "knee", "indicator_matrix", "slo_status")


def forget_analyses(store) -> None:
    """Empty the tables analyses write: passes then start from the requests alone, as on a new store (what
    earlier passes wrote is read back by later ones)."""
    for table in ANALYSIS_TABLES:
        store.command(f"TRUNCATE TABLE {store.table(table)}")
