import os

# Before TensorFlow starts: quiet logs, and TF's pooled CPU allocator, the only
# one that reports peak memory on CPU (see jacobkit.memory).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
