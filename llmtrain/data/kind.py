"""What a recipe's examples are (`DataKind`): all the one row pipeline needs to make them
from rows, and all the one builder (build.py) needs to hold out, pack and number them. Each
method's wing declares its kinds (build.ROWS for SFT rows, preference/pairs.PAIRS,
preference/reward_model.REWARD_PAIRS, preference/unpaired.UNPAIRED, rl/prompts.grpo_prompts) with
this module, which sits below the builder, the stream and the mixture.

Every kind's rows go the same way (prepare.prepare): each source's columns checked
(`columns`), each row made into an example by `make` under one head (`process`: a dropped or
malformed row becomes the kind's `empty` example with its status), rows that must stop the
run stopped, the others dropped and counted alike, an over-long example kept, cut, dropped
or refused by the one length policy (rows.length_status; where to cut is the kind's), the
examples cached under the kind's `version`, and a split with no usable example refused,
naming the kind's `unit`.

Cache versions. A kind's `version` goes into the key of its tokenized rows in the datasets
cache (prepare._fingerprint, beside every setting that changes them); a change to what a kind
makes of a row must change its version, or runs read the rows tokenized before it. Every
kind's key also holds the pipeline's own "llmtrain-data-vN". History:
- llmtrain-data (every kind): v1 the first formats; v2 files read as written, with their
  lines; v3 rows as they come (nothing-to-train rows dropped, data.bad_rows, content parts,
  tools, per-turn train, data.system_prompt); v4 control tokens in message text and parts
  the chat template drops refused; v5 turns with train: false kept out of the loss under
  data.loss_on=all too; v6 rows say which formats they fill (process_row's fits).
- SFT rows (build.ROWS): no version of their own; the key holds data.format instead.
- pairs: v2 the first; v3 messages read as chat rows' are; v4 answers without an assistant
  turn are errors. Reward-model pairs add "-margins" (their margin column), "-margins-v2"
  since CSV margins are read from their text.
- unpaired (KTO): v1 the first; v2 CSV labels read from their text; v3 answers without an
  assistant turn are errors.
- prompts (GRPO): v1 the first; v2 a prefilled last assistant message is continued. The key
  adds grpo.max_completion_length, which sets how long a prompt may be.
- A vision-language model's kinds (their `images`): SFT rows "images-v1"; pairs
  "image-pairs-v1"; unpaired (KTO) "image-unpaired-v1"; GRPO prompts the prompts' version with
  "-images-v1". Their keys also hold the processor's
  settings (prepare.py) and the stamp of the image files the rows name (vision.images_stamp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import DataConfig
from .prepare import prepare
from .rows import processed


@dataclass(frozen=True)
class DataKind:
    """What a recipe's examples are: how rows become them, and how the builder treats them."""

    # (Source, tokenizer, DataConfig) -> None: raises DataError naming the source's key for
    # a source whose columns cannot give this kind's examples (before any row is read).
    columns: Callable
    # What the cache key of its tokenized rows holds for the kind (see the module docstring);
    # empty for SFT rows, whose key holds data.format.
    version: str
    # (row, tokenizer, DataConfig) -> the row's example with its `status` ('ok' or
    # 'truncated'), or the reason the row is dropped; raises rows.RowError for a malformed row
    # (rows.NothingToTrain for one with nothing to train). `process` is its head.
    make: Callable
    empty: dict = field(hash=False)  # a dropped row's columns besides its status, in the example's order
    # The packed view of its examples: (rows, width, sizes per source or None) -> a Dataset;
    # None for a kind that is never packed (its recipe refuses data.packing).
    packed: type | None
    width: int = 1  # a packed sequence's length, in data.max_seq_len
    # What one example is called: in "no usable ..." errors and the lines the builder prints.
    unit: str = "rows"
    pair_hints: bool = False  # whether the fixes for dropped rows are a pair's (DataStats.fixes)
    batched: tuple[str, str] = ("sequences", "sequences")  # what a batch holds, unpacked and packed
    index: str = ""  # a column numbering the examples (training 0..n-1, evaluation after), or none
    # What each split's examples become once held out and numbered, before any mixture:
    # (rows, data.max_seq_len) -> a Dataset whose example i may read other rows of its split
    # (preference/unpaired.KLCompletions), or None to keep the rows.
    view: Callable | None = None
    # (key, examples) -> None: sees each split's examples as soon as they are prepared, before
    # any weights load (rl/prompts.grpo_prompts checks the reward functions against them).
    check_split: Callable | None = None
    # (Source) -> text: what its examples depend on besides the source's own content, for the
    # cache key (vision.images_stamp: the image files its rows name); None for nothing.
    stamp: Callable | None = None
    # The same examples made from a vision-language model's rows, with their images
    # (vision.rows_kind picks it); None for a kind whose rows carry no images, in which an
    # image is a malformed row. SFT rows' (vision.IMAGE_ROWS) sits above this package.
    images: DataKind | None = None

    def process(self, row: dict, tokenizer, cfg: DataConfig) -> dict:
        """One row -> its example with its status, or `empty` with why it is dropped
        ('error: ...' for a malformed row): what the cache holds for each row."""
        return processed(self.make, self.empty, row, tokenizer, cfg)

    def prepare(self, key: str, names: list[str], tokenizer, cfg: DataConfig):
        """One split's examples and their DataStats (prepare.prepare)."""
        return prepare(self, key, names, tokenizer, cfg)
