"""Fixtures of the tier tests: the shared moto S3 server (`conformance/s3.py`), a Mooncake
master per test (`conformance/mooncake.py`)."""
from conformance.mooncake import mooncake_master  # noqa: F401
from conformance.s3 import s3_server  # noqa: F401
