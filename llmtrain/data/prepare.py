"""A whole split of any kind of example (kind.DataKind: SFT rows, pairs, KTO rows, prompts):
every source of data.train (or data.eval) loaded, its columns checked, tokenized row by row
into the datasets cache (keyed on content and the kind's version), stopped at the first row
that must stop the run, filtered and counted (DataStats), in one function, `prepare`."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig
from ..errors import DataError, warn
from ..files import LINE
from ..processor import processor_of
from ..template import MAX_TEMPLATE_CHARS, TemplateLimit, template_source
from .rows import KEPT, REQUIRED, row_problem, several_formats
from .sources import Source, detect_format, load_source

MALFORMED = "malformed, data.bad_rows=skip"
# Why a well-formed row has nothing to train (NothingToTrain), as DataStats counts it.
NOTHING_TO_TRAIN = {
    "empty conversation",
    "no assistant turn",
    "every assistant turn has train: false",
    "empty answer",
    "empty text",
}
SHOWN_BAD = 3  # malformed rows whose location the summary names


@dataclass
class DataStats:
    rows: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    trained_tokens: int = 0
    bad: list[str] = field(default_factory=list)  # where the first malformed rows are, and why
    per_source: list[tuple[str, int, int]] = field(default_factory=list)  # (name, kept rows, trained tokens)

    def count(self, statuses) -> None:
        """Count rows by their process_row status (kept, truncated, or why dropped)."""
        for s in statuses:
            self.rows += 1
            if s in KEPT:
                self.kept += 1
                self.truncated += s == "truncated"
            elif s.startswith("error"):
                self.dropped[MALFORMED] += 1
            else:
                self.dropped["longer than data.max_seq_len" if s.startswith("too long") else s] += 1

    def skip_bad(self, where: str, status: str) -> None:
        """Note a malformed row dropped under data.bad_rows=skip (`count` counts it)."""
        if len(self.bad) < SHOWN_BAD:
            self.bad.append(f"{where}: {status[len('error: ') :]}")

    def check_bad(self, key: str, cfg: DataConfig) -> None:
        """Stop the run when more than data.max_bad_fraction of the rows were malformed."""
        bad = self.dropped[MALFORMED]
        if bad and bad > cfg.max_bad_fraction * self.rows:
            first = "the first" if len(self.bad) == 1 else f"the first {len(self.bad)}"
            raise DataError(
                f"data.max_bad_fraction: {bad} of {self.rows} rows of {key} are malformed ({bad / self.rows:.1%}), "
                f"more than {cfg.max_bad_fraction:g}; {first}: {'; '.join(self.bad)}. Fix the rows, or raise "
                "data.max_bad_fraction"
            )

    def fixes(self, pairs: bool = False) -> str:
        """What to change about the dropped rows (or `pairs`, whose loss is always on the
        answers), by why they were dropped: for an error saying a split has no usable row."""
        reasons, hints = set(self.dropped), []
        if "longer than data.max_seq_len" in reasons:
            hints.append("raise data.max_seq_len, or set data.overlong=truncate")
        if "no trained tokens" in reasons:
            hints.append(
                "raise data.max_seq_len (truncation can cut off what is trained)"
                + ("" if pairs else ", or set data.loss_on=all")
            )
        if reasons & NOTHING_TO_TRAIN:
            hints.append("give rows with something to train (an answer, or text)")
        if "identical answers" in reasons or "an empty answer" in reasons:
            hints.append("give pairs with two different, non-empty answers")
        if MALFORMED in reasons:
            hints.append("fix the malformed rows")
        return "; ".join(hints) or "check data.max_seq_len and data.overlong" + ("" if pairs else " and data.loss_on")

    def summary(self, key: str) -> str:
        parts = [f"{key}: {self.kept}/{self.rows} rows kept"]
        if self.trained_tokens or not self.kept:  # prompt rows (recipes/grpo.py) train no token of their own
            parts[0] += f", {self.trained_tokens} trained tokens"
        if self.truncated:
            parts.append(f"{self.truncated} truncated to data.max_seq_len")
        for reason, n in sorted(self.dropped.items()):
            if reason == MALFORMED and self.bad:
                more = f" and {n - len(self.bad)} more" if n > len(self.bad) else ""
                reason = f"{reason}: {'; '.join(self.bad)}{more}"
            parts.append(f"{n} dropped ({reason})")
        return "; ".join(parts)


# --- a whole split ---------------------------------------------------------------------------


def check_source(src: Source, tokenizer, cfg: DataConfig) -> None:
    """Set src.format from its columns; refuse chat rows with no chat template to render them."""
    src.format = detect_format(src.columns, cfg.format, src.name, src.key)
    conversational = any(set(REQUIRED[f]) <= set(src.columns) for f in ("chat", "sharegpt", "alpaca"))
    own = tokenizer.chat_template  # a configured one was checked at start-up (config.validate)
    if isinstance(own, str) and len(own) > MAX_TEMPLATE_CHARS:
        raise DataError(
            f"{src.key}: {template_source('', tokenizer)} is longer than {MAX_TEMPLATE_CHARS} characters, which no "
            "chat template needs; set data.chat_template to another"
        )
    if conversational and src.format in ("auto", "chat", "sharegpt", "alpaca") and not tokenizer.chat_template:
        raise DataError(
            f"{src.key}: {src.name} has conversational rows but the tokenizer has no chat template; "
            "set data.chat_template to a Jinja template or a .jinja file"
        )


def _fingerprint(source: Source, version: str, tokenizer, cfg: DataConfig, stamp=None) -> str:
    """A stable cache key, so every rank (and the next run) finds the tokenized rows that
    the main process wrote instead of tokenizing again: the source's content, the kind's
    `version` (data.format for SFT rows) and every setting that changes what a row becomes.
    The versions' history is kind.py's note."""
    tok = tokenizer.backend_tokenizer.to_str() if getattr(tokenizer, "is_fast", False) else repr(tokenizer)
    h = hashlib.sha256()
    for part in (
        source.dataset._fingerprint,
        version,
        str(tokenizer.chat_template),
        cfg.loss_on,
        str(cfg.max_seq_len),
        cfg.overlong,
        cfg.system_prompt,
        tok,
        str(tokenizer.eos_token_id),
        images_key(tokenizer, cfg),
        stamp(source) if stamp is not None else "",
        "llmtrain-data-v6",
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def images_key(tokenizer, cfg: DataConfig) -> str:
    """What makes a vision-language model's rows besides its tokenizer: its processor's
    settings (how many tokens an image becomes) and the bounds on images; empty for text."""
    processor = processor_of(tokenizer)
    if processor is None:
        return ""
    settings = (processor.to_json_string(), processor.image_processor.to_json_string())
    return "".join(settings) + f"{cfg.max_images},{cfg.max_image_bytes},{cfg.max_image_pixels}"


def prepare(kind, key: str, names: list[str], tokenizer, cfg: DataConfig):
    """One split of `kind`'s examples (a kind.DataKind): its sources loaded, their columns
    checked, their rows tokenized (`tokenize_sources`), and the split checked by the kind.

    Returns (datasets.Dataset, DataStats). Raises DataError naming the file and line for a
    malformed row or an over-long one under data.overlong=error, and for a split left with
    no usable example."""
    ds, stats = tokenize_sources(kind, key, names, tokenizer, cfg)
    if stats.kept == 0:
        raise DataError(f"{key}: no usable {kind.unit}: {stats.summary(key)}; {stats.fixes(kind.pair_hints)}")
    if kind.check_split is not None:
        kind.check_split(key, ds)
    return ds, stats


def template_error(key: str, where: str, e: TemplateLimit, cfg: DataConfig, tokenizer) -> TemplateLimit:
    """The one line for a chat template past a bound (llmtrain.template) on a row: it stops
    the run whatever data.bad_rows says, since the template is at fault, not the row."""
    return TemplateLimit(
        f"{key}: {where}: {template_source(cfg.chat_template, tokenizer)} {e} on this row, past the bounds "
        "on rendering; fix the template, or set data.chat_template to another"
    )


def tokenize_sources(kind, key: str, names: list[str], tokenizer, cfg: DataConfig):
    """The sources of one split, each loaded, its columns checked (`kind.columns`), tokenized
    row by row (`kind.process`) into the datasets cache, stopped at the first row that must
    stop the run (with its file line), filtered to the kept rows, and concatenated. Returns
    (datasets.Dataset, DataStats); the caller decides what an empty split means."""
    import datasets

    parts, stats = [], DataStats()
    for name in names:
        src = load_source(name, key)
        kind.columns(src, tokenizer, cfg)

        def tokenized(row: dict, i: int, src: Source = src) -> dict:
            try:
                return kind.process(src.parse(row), tokenizer, cfg) | ({LINE: row[LINE]} if src.raw else {})
            except TemplateLimit as e:
                raise template_error(key, src.where(row, i), e, cfg, tokenizer) from None

        ds = src.dataset.map(
            tokenized,
            with_indices=True,
            remove_columns=[c for c in src.dataset.column_names if c != LINE],
            new_fingerprint=_fingerprint(src, kind.version or cfg.format, tokenizer, cfg, kind.stamp),
            desc=f"tokenizing {Path(name).name}",
        )
        status = ds["status"]
        if "fits" in ds.column_names:  # rows read as the first of several formats they fill (process_row)
            for fits, n in Counter(f for f in ds["fits"] if f).items():
                warn(f"{key}: {name}: {n} rows {several_formats(fits)}")
            ds = ds.remove_columns("fits")
        for i, s in enumerate(status):
            if problem := row_problem(s, cfg):
                raise DataError(f"{key}: {src.where(ds[i], i)}: {problem}")
            if s.startswith("error"):
                stats.skip_bad(src.where(ds[i], i), s)
        stats.count(status)
        ds = ds.filter(lambda s: s in KEPT, input_columns="status").remove_columns(["status", LINE][: 1 + src.raw])
        stats.per_source.append((name, len(ds), sum(ds["n_trained"])))
        parts.append(ds)
    stats.check_bad(key, cfg)
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    stats.trained_tokens = sum(n for _, _, n in stats.per_source)
    return ds, stats
