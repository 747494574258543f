"""One local Spark session for every pipeline test (starting one takes seconds), on loopback,
with its event log on (what pipeline.spark_metrics reads)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark_events(tmp_path_factory):
    return tmp_path_factory.mktemp("spark-events")


@pytest.fixture(scope="session")
def spark(spark_events):
    from pipeline.spark import spark_session

    session = spark_session("local[2]", app_name="kafka-quota-proxy tests", shuffle_partitions=4,
                            event_log=spark_events)
    yield session
    session.stop()
