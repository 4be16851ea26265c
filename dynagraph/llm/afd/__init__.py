"""Attention-FFN disaggregation (AFD): attention in vLLM, each layer's FFN on FfnWorkers.

How the pieces fit (``graphs/agg_afd.py``: ``VllmWorker.link(FfnWorker)``)::

    VllmWorker process                       engine-core process (vLLM)
    ------------------                       --------------------------
    attach.AfdAttachment                     models/llama.py | models/mixtral.py
      FfnWorkers from etcd  -- AFD file -->    AfdLayerLoop (models/common.py)
      (settings.AfdEngineConfig)                 per layer: attention here,
                                                 connector.submit / collect
                                               connector.AfdConnector
                                                 plan.RouteTable: who holds layer L
                                                 channel.FfnChannel (shm | tcp, wire)
                                                         |
    FfnWorker process(es)                                v
    ---------------------                    server.FfnServer (threads)
    components/ffn_worker.py  ------------->   ffn.VllmFfn: vLLM's LlamaMLP / MixtralMoE
      publishes ``afd`` metadata in etcd        for the layers (experts) it holds

- ``plugin``: the ``vllm.general_plugins`` entry point; registers the AFD architectures.
- ``microbatch``: splits a batch in two at a request boundary for ping-pong.
- ``errors``: ``AfdError`` / ``ChannelError`` / ``AfdUnavailable``.

Importing this package imports neither vLLM nor the model classes.
"""
