"""Type names for the pandas data the pipeline passes around.

pandas ships no type information (pyproject lets mypy import it untyped), so a pandas DataFrame is
``Any`` under this name: the name says what it is, the checker takes it on trust. Spark's
DataFrame, Column and Row are pyspark's own (typed) classes.
"""

from __future__ import annotations

from typing import Any, TypeAlias

PandasFrame: TypeAlias = Any  # a pandas.DataFrame
PandasSeries: TypeAlias = Any  # a pandas.Series
