"""One local Spark session for every pipeline test (starting one takes seconds), on loopback."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from pipeline.spark import spark_session

    session = spark_session("local[2]", app_name="kafka-quota-proxy tests", shuffle_partitions=4)
    yield session
    session.stop()
