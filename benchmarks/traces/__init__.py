"""Mooncake-format trace replay: records, a synthetic generator, prompt synthesis, an
open-loop replay driver and its report.

Modules: :mod:`.trace` (the record type, JSONL load/save, scaling, statistics),
:mod:`.synth` (seeded shared-prefix, bursty traces), :mod:`.prompts` (hash ids -> token
ids), :mod:`.replay` (the asyncio driver), :mod:`.report` (percentiles, goodput, time
windows) and :mod:`.plots` (matplotlib PNGs).
"""
