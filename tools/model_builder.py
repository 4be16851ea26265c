"""Build a tiny Llama-architecture model directory from text found on this machine.

No model hub is reachable from where dynagraph runs, so tests, benchmarks and the
README demo use a model made here:

    python -m tools.model_builder --out models/tiny-llama [--train-seconds N]
    python -m tools.model_builder --moe     # models/tiny-moe, see tools/moe_builder.py

The directory holds ``config.json`` (Llama: hidden 256, 4 layers, 4 heads, 2 KV
heads, 8192 positions), ``model.safetensors``, a byte-level BPE tokenizer
(``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML chat template, so
``transformers.AutoTokenizer.from_pretrained`` works), ``generation_config.json``
and ``dynagraph_build.json`` (what was built and how long it trained).

The text is the Python Language Reference shipped with the interpreter
(``pydoc_data.topics``) plus docstrings of a fixed list of stdlib modules: nothing is
downloaded. Tokenizer and weights are seeded; training runs ``train_steps`` steps, cut
short by ``train_seconds`` (the build info records the steps done), so the same
machine and Python build the same model unless the time budget runs out first.

The build writes into a temporary sibling directory and renames it into place, so a
crash never leaves half a model; a file lock serialises concurrent builders.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

BOS = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS_TEXT, IM_START, IM_END, PAD)  # ids 0..4 in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "dynagraph_build.json",
)

DOCSTRING_MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "functools", "heapq", "http.client", "inspect", "ipaddress",
    "itertools", "json", "logging", "os", "pathlib", "pickle", "queue", "random", "re",
    "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip

DEFAULT_OUT = Path("models/tiny-llama")
BUILD_FORMAT = 2
"""Bumped when the output changes; older builds are rebuilt by ``ensure_model``."""


@dataclass(frozen=True)
class BuildSpec:
    """Everything that determines the model. Stored in ``dynagraph_build.json``."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    seed: int = 0
    train_steps: int = 800
    train_seconds: float = 600.0
    """Wall-clock budget of the training: a busy machine needs about twice an idle one's
    time for the steps, and a budget that stops training early makes a model that fails
    the e2e tests needing a trained one."""
    seq_len: int = 128
    batch_size: int = 8
    learning_rate: float = 3e-3
    threads: int = 2


# ---------------------------------------------------------------- corpus


def _prose_paragraphs(text: str) -> Iterator[str]:
    """Reflowed prose paragraphs of a reST-ish text; code blocks and headings dropped."""
    for block in text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines or lines[0].startswith((" ", "\t", ">>>")):
            continue
        if any(set(ln.strip()) <= set("*=-~^") for ln in lines):
            continue
        para = " ".join(ln.strip() for ln in lines)
        if len(para) >= 40 and sum(c.isalpha() for c in para) > 0.6 * len(para):
            yield para


def _docstrings(module_name: str) -> Iterator[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    objs: list[Any] = [module]
    for name, value in sorted(vars(module).items()):
        if isinstance(value, types.ModuleType) or name.startswith("_"):
            continue
        if getattr(value, "__module__", None) == module_name:
            objs.append(value)
            if isinstance(value, type):
                objs.extend(v for k, v in sorted(vars(value).items()) if not k.startswith("_"))
    seen: set[str] = set()
    for obj in objs:
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and doc not in seen:
            seen.add(doc)
            yield doc


def local_corpus() -> list[str]:
    """English prose paragraphs from the Python installation, in a fixed order."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics

        texts.extend(topics[key] for key in sorted(topics))
    except ImportError:  # some distributions strip pydoc_data
        log.warning("pydoc_data is missing; building the corpus from docstrings only")
    with warnings.catch_warnings():  # some stdlib modules warn on attribute access
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in DOCSTRING_MODULES:
            texts.extend(_docstrings(name))
    paragraphs = [p for text in texts for p in _prose_paragraphs(text)]
    if len(paragraphs) < 500:
        raise RuntimeError(f"only {len(paragraphs)} paragraphs of local text found")
    return paragraphs


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(paragraphs: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` that prepends BOS when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(paragraphs, trainer=trainer)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
            ),
        ]
    )
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, f"{token} must have id {i}"
    return tok


def _write_tokenizer(tok: Any, out: Path, spec: BuildSpec) -> None:
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD, "unk_token": None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": [EOS_TEXT, IM_START],
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map: dict[str, Any] = {k: v for k, v in special.items() if v is not None}
    special_map["additional_special_tokens"] = [EOS_TEXT, IM_START]
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _render_chat(user: str, assistant: str) -> str:
    return f"{BOS}{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"


def _training_stream(tok: Any, paragraphs: Sequence[str], rng: random.Random) -> list[int]:
    """Token ids: plain paragraphs (BOS .. EOS_TEXT) mixed with one-turn chats.

    A chat asks with a paragraph's first sentence and answers with the rest, so the
    model learns the chat layout and to end its turn with ``<|im_end|>``.
    """
    samples: list[str] = []
    for para in paragraphs:
        head, sep, rest = para.partition(". ")
        if sep and len(rest) > 40 and rng.random() < 0.5:
            samples.append(_render_chat(head + ".", rest[:600]))
        else:
            samples.append(f"{BOS}{para}{EOS_TEXT}")
    rng.shuffle(samples)
    ids: list[int] = []
    for enc in tok.encode_batch(samples, add_special_tokens=False):
        ids.extend(enc.ids)
    return ids


# ---------------------------------------------------------------- model


def _llama_config(spec: BuildSpec, vocab_size: int) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=[3, 1],
        pad_token_id=4,
        dtype="bfloat16",
    )
    return LlamaConfig(**settings)


def _train(model: Any, ids: list[int], spec: BuildSpec) -> dict[str, Any]:
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    warmup = max(1, spec.train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return spec.learning_rate * (step + 1) / warmup
        frac = (step - warmup) / max(1, spec.train_steps - warmup)
        return spec.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))

    model.train()
    start = time.monotonic()
    deadline = start + spec.train_seconds
    loss_val = float("nan")
    step = 0
    said = start
    # bfloat16 autocast is ~1.6x faster than float32 with AVX-512; with AVX2 only, torch
    # emulates it and training ran 20 of 800 steps in 120 s (the model then
    # fails the e2e tests that need a trained model), so float32 there
    fast_bf16 = "AVX512" in torch.backends.cpu.get_cpu_capability()
    while step < spec.train_steps and time.monotonic() < deadline:
        starts = torch.randint(0, len(data) - spec.seq_len, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + spec.seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast_bf16):
            out = model(input_ids=batch, labels=batch)  # the model shifts labels itself
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(out.loss.detach())
        step += 1
        now = time.monotonic()
        if now - said >= PROGRESS_EVERY:
            said = now
            log.info("[3/4] training: %s", training_progress(step, spec, now - start, loss_val))
    elapsed = time.monotonic() - start
    if step < spec.train_steps:
        log.warning("time budget of %.0fs ran out after %d steps", spec.train_seconds, step)
    model.eval()
    return {"steps_done": step, "final_loss": loss_val, "train_seconds_used": round(elapsed, 1)}


PROGRESS_EVERY = 10.0
"""Seconds between two progress lines while training."""


def training_progress(step: int, spec: BuildSpec, elapsed: float, loss: float) -> str:
    """``step 350/800 (44%), loss 3.21, 52s, ~1m06s left``: training stops at
    ``train_steps`` or after ``train_seconds``, whichever comes first, so the progress is
    the larger of the two fractions and the estimate the smaller of the two remainders."""
    by_steps = step / max(spec.train_steps, 1)
    by_time = elapsed / spec.train_seconds if spec.train_seconds > 0 else 0.0
    frac = min(max(by_steps, by_time), 1.0)
    left = min(elapsed / by_steps - elapsed if by_steps > 0 else spec.train_seconds,
               spec.train_seconds - elapsed)
    return (f"step {step}/{spec.train_steps} ({100 * frac:.0f}%), loss {loss:.2f}, "
            f"{_clock(elapsed)}, ~{_clock(max(left, 0.0))} left")


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


def _build_into(tmp: Path, spec: BuildSpec) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)

    t0 = time.monotonic()
    paragraphs = local_corpus()
    corpus_sha = hashlib.sha256("\n".join(paragraphs).encode()).hexdigest()
    log.info("[1/4] corpus: %d paragraphs of local text (%.1fs)", len(paragraphs),
             time.monotonic() - t0)
    t0 = time.monotonic()
    tok = train_tokenizer(paragraphs, spec.vocab_size)
    _write_tokenizer(tok, tmp, spec)
    ids = _training_stream(tok, paragraphs, rng)
    log.info("[2/4] tokenizer: byte-level BPE of %d tokens, %d training tokens (%.1fs)",
             tok.get_vocab_size(), len(ids), time.monotonic() - t0)

    model: Any = LlamaForCausalLM(  # type: ignore[no-untyped-call]  # untyped in transformers
        _llama_config(spec, tok.get_vocab_size()))
    stats: dict[str, Any] = {"steps_done": 0, "final_loss": None, "train_seconds_used": 0.0}
    if spec.train_seconds > 0 and spec.train_steps > 0:
        log.info("[3/4] training: up to %d steps or %s, whichever comes first",
                 spec.train_steps, _clock(spec.train_seconds))
        stats = _train(model, ids, spec)
        log.info("[3/4] training: %d steps in %s, loss %.2f", stats["steps_done"],
                 _clock(stats["train_seconds_used"]), stats["final_loss"])
    t0 = time.monotonic()
    # bfloat16 on disk: vLLM serves it in bfloat16 on the CPU anyway (no downcast warnings).
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    gen = GenerationConfig(  # type: ignore[no-untyped-call]  # untyped in transformers
        bos_token_id=0, eos_token_id=[3, 1], pad_token_id=4)
    gen.save_pretrained(tmp)

    info = {
        "format": BUILD_FORMAT,
        "spec": asdict(spec),
        "corpus_paragraphs": len(paragraphs),
        "corpus_sha256": corpus_sha,
        "training_tokens": len(ids),
        "vocab_size": tok.get_vocab_size(),
        **stats,
    }
    (tmp / "dynagraph_build.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("[4/4] saved (%.1fs)", time.monotonic() - t0)
    return info


# ---------------------------------------------------------------- public API


def is_complete(path: Path, build_format: int = BUILD_FORMAT) -> bool:
    """True if ``path`` holds every file a finished build of ``build_format`` writes."""
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        info = json.loads((path / "dynagraph_build.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format") == build_format


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # a concurrent build finishes in minutes at most
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_atomically(out: Path, build: Callable[[Path], T]) -> T:
    """``build(tmp)`` into a new directory beside ``out``, then swap it in for ``out``: a
    reader never sees a half-written model, and a failed build leaves ``out`` as it was."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        result = build(tmp)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, trash / out.name)
            shutil.rmtree(trash, ignore_errors=True)
        tmp.chmod(0o755)
        os.rename(tmp, out)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


CACHE_ENV = "DYNAGRAPH_MODEL_CACHE"
"""Where finished builds are kept for other checkouts of this machine (default
``~/.cache/dynagraph/models``; ``off``: no cache)."""


def cache_entry(spec: BuildSpec) -> Path | None:
    """The machine-wide cache entry of a build of ``spec`` by this builder (None: off).

    Keyed by everything that determines the model: the build format, the spec, this
    file's source and the versions of the libraries that build it."""
    root = os.environ.get(CACHE_ENV, "")
    if root == "off":
        return None
    from importlib.metadata import version

    base = Path(root) if root else Path.home() / ".cache" / "dynagraph" / "models"
    key = hashlib.sha256(json.dumps({
        "format": BUILD_FORMAT, "spec": asdict(spec),
        "builder": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "versions": [version(name) for name in ("torch", "transformers", "tokenizers")],
    }, sort_keys=True).encode()).hexdigest()[:24]
    return base / f"tiny-llama-{key}"


def _copy_into(src: Path) -> Callable[[Path], None]:
    def copy(tmp: Path) -> None:
        shutil.copytree(src, tmp, dirs_exist_ok=True)

    return copy


def ensure_model(
    out: Path | str = DEFAULT_OUT, spec: BuildSpec | None = None, *, force: bool = False
) -> Path:
    """Build the model into ``out`` unless a complete build is already there; a build of
    the same spec by the same builder on this machine (``cache_entry``) is copied instead
    of trained again, and a new build is kept there.

    Safe to call from several processes at once; returns the absolute path.
    """
    spec = spec or BuildSpec()
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out):
        if is_complete(out) and not force:
            log.debug("model already built at %s", out)
            return out
        cached = cache_entry(spec)
        if cached is not None and is_complete(cached) and not force:
            build_atomically(out, _copy_into(cached))
            log.info("model copied from this machine's cache %s", cached)
            return out
        start = time.monotonic()
        log.info("building %s (corpus, tokenizer, about %s of training, save)", out,
                 _clock(spec.train_seconds))
        info = build_atomically(out, lambda tmp: _build_into(tmp, spec))
        log.info(
            "built %s in %s (%d training steps%s)",
            out,
            _clock(time.monotonic() - start),
            info["steps_done"],
            f", loss {info['final_loss']:.2f}" if info["final_loss"] is not None else "",
        )
        if cached is not None:
            _keep(out, cached)
        return out


def _keep(out: Path, entry: Path) -> None:
    """Copy the build at ``out`` to the cache ``entry`` (atomically; best effort)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with locked(entry):
            if not is_complete(entry):
                build_atomically(entry, _copy_into(out))
    except OSError as exc:
        log.warning("could not keep the model in %s: %s", entry, exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.model_builder", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=None,
                        help=f"model directory (default {DEFAULT_OUT}; with --moe models/tiny-moe)")
    parser.add_argument("--moe", action="store_true",
                        help="build the Mixtral-style MoE model (tools/moe_builder.py)")
    parser.add_argument(
        "--train-seconds",
        type=float,
        default=BuildSpec.train_seconds,
        help="training time budget; 0 skips training (random weights)",
    )
    parser.add_argument("--train-steps", type=int, default=BuildSpec.train_steps)
    parser.add_argument("--seed", type=int, default=BuildSpec.seed)
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="model_builder: %(message)s")
    spec = BuildSpec(train_seconds=args.train_seconds, train_steps=args.train_steps, seed=args.seed)
    if args.moe:
        from tools.moe_builder import DEFAULT_MOE_OUT, ensure_moe_model

        path = ensure_moe_model(args.out or DEFAULT_MOE_OUT, force=args.force)
    else:
        path = ensure_model(args.out or DEFAULT_OUT, spec, force=args.force)
    print(path)  # the command's output, for scripts
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
