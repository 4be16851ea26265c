"""The ``hermes`` tool-call parser: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Behaves as vLLM 0.32's ``Hermes2ProToolParser`` (same content, same tool calls, same
streamed deltas), which Qwen, Hermes and many other models' chat templates produce.
One instance per choice: streaming keeps state.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

START = "<tool_call>"
END = "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


def tool_call_id() -> str:
    """A fresh OpenAI tool call id, in vLLM's format."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def partial_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class HermesToolParser:
    """Finds tool calls in a choice's text, whole (:meth:`extract`) or streamed (:meth:`feed`)."""

    def __init__(self) -> None:
        self._text = ""
        self._sent_content = 0
        self._names: list[str] = []
        self._args: list[str] = []

    # -- whole text ---------------------------------------------------------------------

    @staticmethod
    def extract(text: str) -> tuple[list[dict[str, str]] | None, str | None]:
        """``(calls, content)``: calls as ``{"name", "arguments"}`` (arguments a JSON
        string) or None when the text holds no (parseable) tool call; content is the
        text before the first ``<tool_call>`` (None if empty) or the whole text."""
        if START not in text:
            return None, text
        try:
            calls = []
            for whole, rest in _CALL.findall(text):
                raw = json.loads(whole if whole else rest)
                calls.append({"name": raw["name"],
                              "arguments": json.dumps(raw["arguments"], ensure_ascii=False)})
        except (ValueError, KeyError, TypeError):
            return None, text
        content = text[: text.find(START)]
        return calls, content or None

    # -- streaming ----------------------------------------------------------------------

    def feed(self, delta: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Add ``delta``; return ``(content, tool_call_deltas)`` to send now.

        Content is text before the first ``<tool_call>``, holding back a suffix that
        may start one. Each call gets a delta with its ``id``, ``type`` and ``name``
        once the name is complete, then deltas appending to its ``arguments``.
        """
        self._text += delta
        text = self._text
        content = self._content(text)
        deltas: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(self._bodies(text)):
            if i >= len(self._names):
                name = _NAME.search(body)
                if name is None:
                    break
                self._names.append(name.group(1))
                self._args.append("")
                deltas.append({"index": i, "type": "function", "id": tool_call_id(),
                               "function": {"name": name.group(1)}})
            args = self._arguments(body, complete)
            if args is not None and len(args) > len(self._args[i]):
                deltas.append({"index": i, "function": {"arguments": args[len(self._args[i]):]}})
                self._args[i] = args
        return content, deltas

    def _content(self, text: str) -> str | None:
        at = text.find(START)
        sendable = len(text) - partial_overlap(text, START) if at == -1 else at
        if sendable > self._sent_content:
            content = text[self._sent_content:sendable]
            self._sent_content = sendable
            return content
        return None

    @staticmethod
    def _bodies(text: str) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            begin = start + len(START)
            end = text.find(END, begin)
            if end != -1:
                out.append((text[begin:end].strip(), True))
                pos = end + len(END)
                continue
            raw = text[begin:]
            overlap = partial_overlap(raw, END)
            body = (raw[:-overlap] if overlap else raw).strip()
            out.append((body, _is_json(body) if body else False))
            break
        return out

    @staticmethod
    def _arguments(body: str, complete: bool) -> str | None:
        match = _ARGS.search(body)
        if match is None:
            return None
        raw = body[match.end():]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw
