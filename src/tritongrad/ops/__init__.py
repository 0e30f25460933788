"""One folder per operator: kernels.py (Triton), launch.py (host launchers + registration), reference.py."""
