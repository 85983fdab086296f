"""What a run tells: bad rows (each on stderr as it is found, all in the manifest), the counts, and the
progress bar (documents/s, tokens/s, time left)."""

from __future__ import annotations

import sys
import time
from collections import Counter

from tqdm import tqdm

from .sources import BadRow


class RunReport:
    """Counts of one run and its bad rows, and the progress bar they advance."""

    def __init__(self, *, progress: bool) -> None:
        self.progress = progress
        self.bad_rows: list[dict] = []
        self.bad_kinds: Counter = Counter()
        self.embedded = 0
        self.tokens = 0
        self.truncated = 0
        self.bar: tqdm | None = None
        self._start = time.monotonic()

    def open_bar(self, total: int | None, desc: str) -> None:
        self.close_bar()
        self._start = time.monotonic()
        self._tokens_at_start = self.tokens
        self.bar = tqdm(total=total, desc=desc, unit="doc", file=sys.stderr, disable=not self.progress,
                        dynamic_ncols=True, smoothing=0.1)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def say(self, line: str) -> None:
        """A line on stderr that does not tear the bar."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def bad(self, row: BadRow, *, advance: bool = True) -> None:
        self.bad_rows.append(row.as_dict())
        self.bad_kinds[row.kind] += 1
        who = f" (id {row.id!r})" if row.id is not None else ""
        self.say(f"yoso-embed: skipped {row.where}{who}: {row.kind}: {row.message}")
        if advance:
            self.step()

    def done(self, tokens: int, truncated: bool = False) -> None:
        self.embedded += 1
        self.tokens += tokens
        self.truncated += truncated
        self.step()

    def step(self, n: int = 1) -> None:
        if self.bar is None:
            return
        self.bar.update(n)
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self.bar.set_postfix_str(f"{(self.tokens - self._tokens_at_start) / elapsed:,.0f} tokens/s", refresh=False)

    def counts(self) -> dict:
        return {"embedded": self.embedded, "tokens": self.tokens, "truncated": self.truncated,
                "bad": sum(self.bad_kinds.values()), "bad_by_kind": dict(sorted(self.bad_kinds.items()))}
