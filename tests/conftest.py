"""Settings for every test under tests/.

Hypothesis runs without its wall-clock checks (the per-example ``deadline`` and the ``too_slow``
health check on data generation): they measure the machine, not the code, and fail tests on a loaded
2-core CI runner (a set of integers took too long to draw while another job ran). Properties still
run their full example counts."""

from hypothesis import HealthCheck, settings

settings.register_profile("sluice", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("sluice")
