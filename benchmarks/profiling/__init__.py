"""Measuring timing profiles for the mocker engine (``dynagraph.llm.engines.mocker``).

- ``profile_vllm_cpu``: vLLM's step times on the CPU, in-process or as served
  (``profile_served`` holds the served probers).
- ``calibrate_profile``: corrects a served profile by the mocker graph's error against it.
- ``profile_gpu``: a Llama-shaped model's step times in plain PyTorch (``profile_gpu_model``,
  ``profile_gpu_attention``, ``profile_gpu_timing``).

Run from the repository root: ``python -m benchmarks.profiling.profile_vllm_cpu ...``,
``python -m benchmarks.profiling.calibrate_profile ...``,
``python3 benchmarks/profiling/profile_gpu.py ...``.
"""
