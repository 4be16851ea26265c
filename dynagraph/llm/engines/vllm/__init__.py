"""The vLLM engine and the plugins vLLM loads in its own processes.

    args         VllmEngineArgs: the engine's config schema
    env          the environment vLLM's processes start with (CPU binding, huge pages, OpenMP)
    kv_config    vLLM's KVTransferConfig (NIXL connector, host KV pool) and block hashing
    convert      SamplingSpec -> vLLM's SamplingParams, vLLM's outputs -> EngineOutput
    engine       VllmEngine: the AsyncLLM's life cycle behind the Engine protocol
    compression_guards
                 the KV codecs' quality guards the engine runs at start
    stats        vLLM's stat-logger hook -> the engine's load snapshot
    adapter      every patch of vLLM internals, and the vLLM versions supported
    engine_cores, engine_spin, cpu_amx
                 vLLM general plugins (``pyproject.toml``), run in each vLLM process

Importing this package, or any module of it but the plugins' ``register``, does not import
vLLM.
"""
