"""vLLM general plugin: registers the AFD model architectures, nothing else.

Entry point (``pyproject.toml``)::

    [project.entry-points."vllm.general_plugins"]
    dynagraph_afd = "dynagraph.llm.afd.plugin:register"

vLLM calls ``register()`` in every process it starts (the API process, the engine
core, workers), possibly several times. It adds two architecture names to vLLM's
``ModelRegistry``, as lazy ``module:Class`` strings (nothing is imported until a model
asks for them), and patches nothing. A model is served with AFD only when its
``architectures`` name one of them, which the VllmWorker does through ``hf_overrides``
when an FfnWorker is linked; any other model is untouched, so the plugin is inert.
"""

from __future__ import annotations

ARCHITECTURES: dict[str, str] = {
    "AfdLlamaForCausalLM": "dynagraph.llm.afd.models.llama:AfdLlamaForCausalLM",
    "AfdMixtralForCausalLM": "dynagraph.llm.afd.models.mixtral:AfdMixtralForCausalLM",
}
"""AFD architecture name -> the class vLLM imports when a model names it."""

AFD_ARCHITECTURE: dict[str, str] = {
    "llama": "AfdLlamaForCausalLM",
    "mixtral": "AfdMixtralForCausalLM",
}
"""Model family (``FfnModelInfo.arch``) -> its AFD architecture name."""


def register() -> None:
    """Add the AFD architectures to vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for arch, target in ARCHITECTURES.items():
        if arch not in known:
            ModelRegistry.register_model(arch, target)
