"""Device backends: cpu (reference), cuda (cuda-python), rocm (hip-python)."""
