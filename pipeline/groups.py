"""Per-group Python work over a DataFrame without one Arrow exchange per group.

``groupBy(...).applyInPandas`` hands Python each group as an Arrow batch of its own, which costs
a few milliseconds a group whatever its size: thousands of (principal, kind) groups cost more
than the work done on them. Here the rows are hashed over tasks by their keys, sorted by Spark
within each task, and streamed to Python in Arrow batches (``mapInPandas``); :func:`groups_of`
cuts the batches back into whole groups, in order, holding one group (and a batch) at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from .frames import PandasFrame

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

OUT_ROWS = 10_000  # result rows a task collects before it hands them to Spark
ROWS_PER_TASK = 1_000_000  # input rows per task, about, for a large input


def tasks_for(df: DataFrame, rows: int | None = None) -> int:
    """Tasks for ``df`` (about ``rows`` rows): a whole number of rounds of the session's cores, so
    no core waits on one last task; at least two rounds, more for a large input."""
    cores = df.sparkSession.sparkContext.defaultParallelism
    return cores * max(2, -(-(rows or 0) // (cores * ROWS_PER_TASK)))


def per_group(df: DataFrame, keys: Sequence[str], order: Sequence[str], tasks: int,
              build: Callable[[], Callable[[PandasFrame], Sequence[tuple[object, ...]]]], schema: str) -> DataFrame:
    """``schema``'s rows: ``build()`` (called once per task, on the executor) applied to each group
    of ``df`` by ``keys``, the group's rows sorted by ``order``, in ``tasks`` tasks (a number:
    adaptive execution keeps it, as little data may be much work)."""
    columns = [c.split()[0] for c in schema.split(", ")]

    def per_task(batches: Iterable[PandasFrame]) -> Iterator[PandasFrame]:
        import pandas as pd

        run = build()
        out: list[tuple[object, ...]] = []
        for rows in groups_of(batches, keys):
            out += run(rows)
            if len(out) >= OUT_ROWS:
                yield pd.DataFrame(out, columns=columns)
                out = []
        if out:
            yield pd.DataFrame(out, columns=columns)

    return df.repartition(tasks, *keys).sortWithinPartitions(*keys, *order).mapInPandas(per_task, schema)


def groups_of(batches: Iterable[PandasFrame], keys: Sequence[str]) -> Iterator[PandasFrame]:
    """Each group's rows, whole, in order and re-indexed from 0, from ``batches`` sorted by
    ``keys``: a group's rows may span batches; what is held is one group's rows and the batch
    being read."""
    import numpy as np
    import pandas as pd

    pending: list[PandasFrame] = []  # the rows so far of the group the last batch ended with

    def whole() -> PandasFrame:
        rows = pending[0] if len(pending) == 1 else pd.concat(pending)
        pending.clear()
        return rows.reset_index(drop=True)

    for batch in batches:
        if batch.empty:
            continue
        values = [batch[k].to_numpy() for k in keys]
        if pending and tuple(pending[-1][k].iat[-1] for k in keys) != tuple(v[0] for v in values):
            yield whole()
        changed = np.zeros(len(batch) - 1, dtype=bool)
        for v in values:
            changed |= v[1:] != v[:-1]
        starts = [0, *(np.flatnonzero(changed) + 1).tolist()]
        for a, b in itertools.pairwise(starts):
            pending.append(batch.iloc[a:b])
            yield whole()
        pending.append(batch.iloc[starts[-1]:])
    if pending:
        yield whole()
