"""Streaming detokenization: token ids in, stable text deltas out.

Design
------
Two layers, each with one invariant.

**Token layer (bytes → stable text).** Decoding one token at a time is wrong for real
tokenizers: SentencePiece strips the leading space of the first token it decodes, and a
multi-byte UTF-8 character may be spread over several byte-fallback / byte-level tokens
that each decode to U+FFFD on their own. As streaming detokenizers do, we keep a short
*window* of the most recent token ids and re-decode the whole window after each add:

* ``window`` - the last few ids (special ids already dropped when skipping them, so the
  window never starts with an invisible token that would change SentencePiece's
  leading-space stripping);
* ``emitted`` - how many characters of ``decode(window)`` have already been handed out.

After appending new ids, ``text = decode(window)``; everything up to the trailing run of
U+FFFD is stable (a dangling replacement character may still become a real character when
its remaining bytes arrive), so the delta is ``text[emitted:stable_end]``. Because the
decode of a window is a prefix-stable function of its ids, ``text[:emitted]`` never changes.
To keep the work O(window) per token instead of O(n), once the window grows past
``2 * _CONTEXT`` ids it is cut to roughly its last ``_CONTEXT`` ids and ``emitted`` is
re-based on the new window. The cut must land on a character boundary where the short
window decodes to a suffix of the long window's text; then the not-yet-emitted trailing
characters (at most one partial character, in the last few ids) are the same in both.

Known limit: for *invalid* UTF-8 byte runs, HF's byte-fallback decoder turns the whole run
into U+FFFD, including valid bytes before the bad one, which no streaming decoder can
reproduce without unbounded hold-back; we emit the valid prefix. Valid text always matches
``tokenizer.decode`` exactly.

**Text layer (stop strings and patterns).** Stable text goes through a hold-back buffer: the
longest tail that is a proper prefix of some stop string is held, and for a stop pattern
(SGLang's ``stop_regex``) the tail from where a match could still complete (the ``regex``
package's partial matching: ``[0-9]+[.]`` holds "12" until a character that cannot continue it),
so no part of a stop is emitted before the stop can be recognised. When a stop string or a
pattern's match appears (the earliest), text is truncated before it (or after it with
``include_stop``), ``stopped`` is set (the string, or the pattern), and every later ``add``
returns ``""``. Before ``min_tokens`` tokens nothing is held or looked for (vLLM's rule: a
stop ends a request only once its minimum is out). ``finish()`` flushes the held tail, including a trailing partial
character as U+FFFD, exactly as ``tokenizer.decode`` would render it.

**The token layer in Rust.** With a fast (Rust) tokenizer, the same window algorithm runs in
the tokenizers library itself (``tokenizers.decoders.DecodeStream``: it re-decodes its few
recent ids per token and hands out the new text once it does not end in U+FFFD), a third of
the cost per token. It holds a partial character's ids back without saying so; this class
counts them (``_held_ids``, the tail of its own short ``window``) and ``finish()`` decodes them
after their context as the Python window would. A slow tokenizer keeps the Python window, and
so does a request whose ids the stream refuses (it raises on some invalid byte runs): the
window takes over from the ids whose text is out. Valid text comes out exactly as before (and
as ``tokenizer.decode``); on invalid UTF-8 byte runs (the known limit below) the two layers
may place U+FFFD differently.

Works with a HF tokenizer or anything exposing one as ``.hf`` (our `TextTokenizer`).
No torch import here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import regex as _regex      # transformers' own dependency; partial matches for stop patterns

try:                        # the token layer in Rust (tokenizers >= 0.21)
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:         # pragma: no cover - an older tokenizers: the window in Python
    _DecodeStream = None

__all__ = ["IncrementalDetokenizer", "special_token_ids"]

_REPLACEMENT = "\ufffd"
_CONTEXT = 6          # ids kept for context when the window is cut


def special_token_ids(hf_tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
    ids: set[int] = set(getattr(hf_tokenizer, "all_special_ids", ()) or ())
    added = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
    for tid, tok in added.items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into stable text deltas.

    ``add(ids)`` returns the newly stable text, ``finish()`` what was held back; their
    concatenation equals ``.text``. ``.stopped`` is the stop string that ended the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop: bool = False,
        special_ids: frozenset[int] | None = None,
        stop_regex: Iterable[str] = (),
        min_tokens: int = 0,
    ) -> None:
        self._hf = getattr(tokenizer, "hf", tokenizer)
        # A fast (Rust) tokenizer decodes with its backend: `hf.decode(ids, clean_up=False)` is
        # exactly `backend.decode(ids, skip_special_tokens=...)` plus argument conversion that
        # cost 3/4 of the time per token here. Anything else goes through `hf.decode`.
        backend = getattr(self._hf, "_tokenizer", None) if getattr(self._hf, "is_fast", False) else None
        self._backend = backend if hasattr(backend, "decode") else None
        self.skip_special_tokens = skip_special_tokens
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.stop_regex = tuple(_regex.compile(p) for p in stop_regex) if stop_regex else ()
        self.min_tokens = min_tokens
        if skip_special_tokens:
            self._skip = special_ids if special_ids is not None else special_token_ids(self._hf)
        else:
            self._skip = frozenset()
        self._window: list[int] = []
        self._emitted = 0           # chars of decode(window) already passed to the text layer
        # the Rust token layer (a fast tokenizer): its stream, and how many of the window's last
        # ids it holds back (an incomplete character: their text is not out yet)
        self._stream = (_DecodeStream(skip_special_tokens=skip_special_tokens)
                        if self._backend is not None and _DecodeStream is not None else None)
        self._held_ids = 0
        self._held = ""             # stable text held back as a possible stop-string prefix
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self.stopped: str | None = None
        self.finished = False
        self.num_tokens = 0

    # ----------------------------------------------------------------- public

    @property
    def text(self) -> str:
        """All text emitted so far (held-back text excluded)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
            self._parts = [self._text_cache]
        return self._text_cache

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated ids; return the text that became stable."""
        if self.stopped is not None or self.finished:
            return ""
        if self._stream is not None:
            chunk = self._stream_chunk(token_ids)
        else:
            window, skip = self._window, self._skip
            n0 = len(window)
            for t in token_ids:          # one id a step nearly always: no list is built for it
                self.num_tokens += 1
                t = int(t)
                if t not in skip:
                    window.append(t)
            if len(window) == n0:
                return ""
            chunk = self._window_chunk()
        if not (self.stop or self.stop_regex) and not self._held:   # no stop to look for: the chunk as it is
            if chunk:
                self._parts.append(chunk)
                self._text_cache = None
            return chunk
        return self._push(chunk, final=False)

    def _window_chunk(self) -> str:
        """The Python token layer: the window's newly stable text (ids just appended)."""
        window = self._window
        text = self._decode(window)
        stable_end = len(text.rstrip(_REPLACEMENT))
        chunk = ""
        if stable_end > self._emitted:
            chunk = text[self._emitted:stable_end]
            self._emitted = stable_end
        if len(window) > 2 * _CONTEXT:
            self._rebase(text)
        return chunk

    def _stream_chunk(self, token_ids: Iterable[int]) -> str:
        """The Rust token layer (see the module doc): the text the ids made stable."""
        step, backend = self._stream.step, self._backend     # type: ignore[union-attr]
        window, skip = self._window, self._skip
        chunk = ""
        ids = iter(token_ids)
        for t in ids:
            self.num_tokens += 1
            t = int(t)
            if t in skip:
                continue
            window.append(t)
            try:
                piece = step(backend, t)
            except Exception:      # it refuses some invalid byte runs: the Python window goes on
                return chunk + self._to_window(ids)
            if piece is None:
                self._held_ids += 1
            else:
                chunk += piece
                self._held_ids = 0
        if len(window) > 2 * _CONTEXT:          # kept: the held ids and context enough for `finish`
            keep = _CONTEXT + self._held_ids
            if keep < len(window):
                del window[:len(window) - keep]
        return chunk

    def _to_window(self, rest: Iterable[int]) -> str:
        """Hand the token layer to the Python window: the window's text up to the ids the stream
        held back and the one it refused (the window's last) is out; then the `rest` of the ids."""
        window = self._window
        self._stream = None
        self._emitted = len(self._decode(window[:len(window) - self._held_ids - 1]))
        self._held_ids = 0
        for t in rest:
            self.num_tokens += 1
            t = int(t)
            if t not in self._skip:
                window.append(t)
        return self._window_chunk()

    def finish(self) -> str:
        """Flush everything held back (a trailing partial character comes out as U+FFFD)."""
        if self.stopped is not None or self.finished:
            self.finished = True
            return ""
        if self._stream is not None:
            chunk = ""
            if self._held_ids:       # the held ids' text after their context, as decode renders it
                before = self._decode(self._window[:-self._held_ids])
                chunk = self._decode(self._window)[len(before):]
                self._held_ids = 0
            out = self._push(chunk, final=True)
            self.finished = True
            return out
        text = self._decode(self._window)
        chunk = text[self._emitted:]
        self._emitted = len(text)
        out = self._push(chunk, final=True)
        self.finished = True
        return out

    # --------------------------------------------------------------- internals

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:   # what a fast tokenizer's decode calls, minus ~25 us of wrapping
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self._hf.decode(ids, skip_special_tokens=self.skip_special_tokens,
                               clean_up_tokenization_spaces=False)

    def _rebase(self, text: str) -> None:
        """Cut the window to (about) its last ``_CONTEXT`` ids, keeping ``emitted`` consistent.

        A cut is accepted only where the kept ids decode to a suffix of the current text
        that does not start with U+FFFD: i.e. at a character boundary, where the decode of
        the short window agrees with the long one (a byte-fallback run cut mid-character
        decodes to replacement characters as a whole, so such cuts are rejected). If no
        nearby cut qualifies, the window is kept and the cut is retried on the next add.
        """
        pending = len(text) - self._emitted
        if pending < 0 or len(text.rstrip(_REPLACEMENT)) < self._emitted:
            return
        for start in range(len(self._window) - _CONTEXT, len(self._window) - 2 * _CONTEXT, -1):
            if start <= 0:
                return
            kept = self._window[start:]
            kept_text = self._decode(kept)
            if (len(kept_text) >= pending and kept_text and not kept_text.startswith(_REPLACEMENT)
                    and text.endswith(kept_text)):
                self._window = kept
                self._emitted = len(kept_text) - pending
                return

    def _push(self, chunk: str, *, final: bool) -> str:
        """Text layer: hold back possible stop-string prefixes and partial stop-pattern
        matches, detect stops (not before ``min_tokens`` tokens: vLLM's rule)."""
        if not (self.stop or self.stop_regex) or self.num_tokens < self.min_tokens:
            return self._emit(self._take_held() + chunk)
        buf = self._held + chunk
        hit_at, hit_end, hit = -1, -1, None
        for s in self.stop:
            at = buf.find(s)
            if at != -1 and (hit_at == -1 or at < hit_at or (at == hit_at and at + len(s) > hit_end)):
                hit_at, hit_end, hit = at, at + len(s), s
        for pat in self.stop_regex:
            m = pat.search(buf)
            if m is not None and (hit_at == -1 or m.start() < hit_at):
                hit_at, hit_end, hit = m.start(), m.end(), pat.pattern
        if hit is not None:
            self.stopped = hit
            self._held = ""
            return self._emit(buf[:hit_end] if self.include_stop else buf[:hit_at])
        if final:
            self._held = ""
            return self._emit(buf)
        hold = self._held_tail(buf)
        for pat in self.stop_regex:      # a match may still complete from this point on
            m = pat.search(buf, partial=True)
            if m is not None:
                hold = max(hold, len(buf) - m.start())
        self._held = buf[len(buf) - hold:] if hold else ""
        return self._emit(buf[:len(buf) - hold])

    def _take_held(self) -> str:
        held, self._held = self._held, ""
        return held

    def _held_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, s: str) -> str:
        if s:
            self._parts.append(s)
            self._text_cache = None
        return s
