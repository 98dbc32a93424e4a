"""``kvlab sweep``: the study across many models, texts, experiments and seeds, locally or on Ray.

A grid (``grid.py``) expands into cells; each cell is one experiment on one model and text with one
seed, keyed by a hash of everything that decides its result (``grid.cell_key``). Cells run in a local
process pool (``local.py``) or on a Ray cluster (``ray_backend.py``); both call ``cells.run_cell``,
which writes the usual run folder atomically, so ``--resume`` can trust any folder it finds.
``report.py`` writes one page with cross-model tables and plots. Design page: docs/sweeps.md.
"""

from kvlab.study.sweep.grid import Cell, Grid, load_grid
from kvlab.study.sweep.run import run_sweep

__all__ = ["Cell", "Grid", "load_grid", "run_sweep"]
