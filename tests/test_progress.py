"""Progress bars of long runs (evals/progress.py) in a terminal and in a log."""
from types import SimpleNamespace

from edgekv.evals.progress import Progress


def test_progress_in_a_log_has_no_cursor_moves_and_keeps_its_results_and_count(capsys):
    """A lent GPU's captured output (stderr not a terminal) was garbled by the inner bar's cursor-up escapes; there
    it is left out, the outer bar still counts the cells, and result lines stay."""
    with Progress(2, "bench points") as progress:
        for i in range(2):
            with progress.cell(f"batch {i}") as on_event:
                on_event(SimpleNamespace(kind="decode_step_end"))
                progress.write(f"  full {i} tok/s")
    err = capsys.readouterr().err
    assert "\x1b[A" not in err and "batch 0" not in err
    assert "  full 0 tok/s" in err and "  full 1 tok/s" in err and "2/2" in err
