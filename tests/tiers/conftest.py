"""Fixtures of the tier tests: the shared moto S3 server (`conformance/s3.py`)."""
from conformance.s3 import s3_server  # noqa: F401
