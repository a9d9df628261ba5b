"""Settings for every kvhal test.

Hypothesis' per-example deadline (200 ms by default) is a timing assertion: on a loaded 2-core
machine one example of a correct property took 846 ms, and the run failed as "flaky". Tests
here check behaviour, speed lives in `kvhal bench`, so no example has a deadline.
"""
from hypothesis import settings

settings.register_profile("kvhal", deadline=None)
settings.load_profile("kvhal")
