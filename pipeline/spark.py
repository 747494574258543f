"""The Spark session and the usage log as a DataFrame, checked before anything is computed."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal, cast

from usage.schema import ADDED_IN, COLUMN_NAMES, READABLE_VERSIONS, arrow_schema, zero_of

from .errors import UsageError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

# What the executors import (never proxy: a Spark job loads no asyncio, no prometheus-client).
_PACKAGES = ("config", "quotas", "pipeline", "protocol", "usage")


def spark_session(master: str = "local[*]", app_name: str = "kafka-quota-proxy report",
                  shuffle_partitions: int | None = None, driver_memory: str | None = None,
                  console_progress: bool = True, event_log: Path | None = None) -> SparkSession:
    """A session on ``master``. Locally the workers run this interpreter; on a cluster the
    project's packages are shipped to the executors (their Python needs pandas and pyarrow).
    ``event_log``: a directory for Spark's event log (what :mod:`.spark_metrics` reads)."""
    from pyspark.sql import SparkSession

    local = master.startswith("local")
    if local:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master).appName(app_name)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "true" if console_progress else "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.adaptive.enabled", "true")
    )
    if local:
        # Everything stays on this machine: bind to loopback, and no web UI.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (builder.config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.ui.enabled", "false"))
    if shuffle_partitions or local:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions or 2 * (os.cpu_count() or 2)))
    if driver_memory:
        builder = builder.config("spark.driver.memory", driver_memory)
    if event_log is not None:
        from .spark_metrics import enable_event_log

        builder = enable_event_log(builder, event_log)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not local:
        spark.sparkContext.addPyFile(str(_project_zip()))
    return spark


def _project_zip() -> Path:
    """The packages the executors import, with every file the packages hold (the message
    definitions of protocol/schemas included), as the installed package ships them."""
    root = Path(__file__).resolve().parents[1]
    out = Path(tempfile.mkdtemp(prefix="kqp-pyfiles-")) / "kafka_quota_proxy.zip"
    with zipfile.ZipFile(out, "w") as z:
        for package in _PACKAGES:
            for path in sorted((root / package).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                    z.write(path, path.relative_to(root))
    return out


def spark_schema() -> StructType:
    """The usage log's Arrow schema as Spark reads it; every column nullable, so that a file
    lacking one reads as nulls and is reported (see read_usage)."""
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import from_arrow_schema

    return T.StructType([T.StructField(f.name, f.dataType, True) for f in from_arrow_schema(arrow_schema())])


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def check_local(directory: str) -> None:
    """Raises UsageError unless ``directory`` holds at least one visible usage file."""
    root = Path(directory.removeprefix("file://"))
    if not root.is_dir():
        raise UsageError(f"usage directory {directory} does not exist or is not a directory")
    files = (p for p in root.rglob("*.parquet")
             if not any(part.startswith((".", "_")) for part in p.relative_to(root).parts))
    if next(files, None) is None:
        raise UsageError(f"no usage log files (*.parquet) under {directory}: is usage_log.directory right, "
                         "and has the proxy run for one interval?")


def read_usage(spark: SparkSession, directory: str, since: datetime | None = None,
               until: datetime | None = None) -> DataFrame:
    """The usage log under ``directory`` (files of every proxy), rows in [since, until), as
    the current schema version: an older file's missing columns read as their type's zero (0, or
    "" for ``fleet``: that proxy enforced alone, as every proxy did before fleets).

    Raises UsageError naming the file when a file is not readable Parquet, lacks the schema's
    columns, or carries a schema version this report does not read; and when nothing is left
    to report on.
    """
    from pyspark.sql import functions as F

    if is_local(directory):
        check_local(directory)
    # Every file below, whatever the layout (date=/hour= from the proxy, or compacted elsewhere).
    reader = (spark.read.schema(spark_schema()).option("pathGlobFilter", "*.parquet")
              .option("recursiveFileLookup", "true"))
    df = reader.parquet(directory).select(*COLUMN_NAMES)
    with spark_errors():
        bad = (df.where(F.col("schema_version").isNull() | ~F.col("schema_version").isin(*READABLE_VERSIONS))
                 .select(F.input_file_name().alias("file"), F.col("schema_version")).distinct().limit(5).collect())
    if bad:
        listed = "; ".join(f"{r.file} (schema_version "
                           f"{r.schema_version if r.schema_version is not None else 'missing'})"
                           for r in bad)
        raise UsageError(f"usage log files of an unknown schema version (this report reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}): {listed}")
    for name, version in ADDED_IN.items():
        df = df.withColumn(name, F.when(F.col("schema_version") < version, F.lit(zero_of(name))).otherwise(F.col(name))
                           .cast(df.schema[name].dataType))
    if since is not None:
        df = df.where(F.col("interval_start") >= F.lit(since))
    if until is not None:
        df = df.where(F.col("interval_start") < F.lit(until))
    return df


class spark_errors:
    """Turns Spark's read failures into a UsageError naming the file."""

    def __enter__(self) -> spark_errors:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if exc is None or isinstance(exc, UsageError):
            return False
        text = str(exc)
        exc_type = cast("type[BaseException]", exc_type)  # not None: exc is not
        if exc_type.__name__ not in ("Py4JJavaError", "SparkException") and "pyspark" not in exc_type.__module__:
            return False
        executor = _executor_failure(text)
        if executor is not None:
            # The job's own code failed on an executor: not something wrong with the user's files.
            raise UsageError(f"a Spark executor failed running the report's code: {executor}") from exc
        file = re.search(r"((?:file:|hdfs:|s3a?:|gs:|abfss?:)?/[^\s,'\"]+\.parquet)", text)
        reason = _reason(text)
        where = f" {file.group(1)}" if file else ""
        raise UsageError(f"cannot read usage log file{where}: {reason}") from exc


def _executor_failure(text: str) -> str | None:
    """The Python error an executor's worker raised (its last traceback line), if ``text`` is
    one: an import or a file of the shipped code missing, an exception in a UDF."""
    if "Traceback (most recent call last)" not in text and "PythonException" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line)
              and not line.startswith(("org.apache", "py4j", "pyspark.errors"))]
    return (errors[-1] if errors else lines[-1])[:300]


def _reason(text: str) -> str:
    for pattern, reason in (
        (r"not a Parquet file|magic number|Expected \d+ bytes|EOFException|Could not read footer|corrupt",
         "not a complete Parquet file (half written or damaged)"),
        (r"cannot be converted|Parquet column|schema", "its columns do not match the usage log schema"),
    ):
        if re.search(pattern, text, re.IGNORECASE):
            return reason
    first = next((line.strip() for line in text.splitlines() if line.strip()), "unknown error")
    return first[:300]


def parse_time(value: str) -> datetime:
    """ISO 8601 date or date-time; UTC unless an offset is given."""
    try:
        t = datetime.fromisoformat(value)
    except ValueError as exc:
        raise UsageError(f"not an ISO 8601 time: {value!r} (e.g. 2026-11-21 or 2026-11-21T13:00)") from exc
    return t if t.tzinfo else t.replace(tzinfo=UTC)
