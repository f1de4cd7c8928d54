"""Settings for every test run (tests/ and the notebooks), before TF starts."""

import os

# Quiet TensorFlow's logs, and use its pooled CPU allocator, the only one that
# reports peak memory on CPU (see jacobkit.memory).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# Notebooks run at their small size under pytest (the kernels inherit this).
os.environ.setdefault("JACOBKIT_NOTEBOOK_SIZE", "small")
