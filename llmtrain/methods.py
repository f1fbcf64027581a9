"""The method table: every training method llmtrain runs, by name, each declared in its own
wing (core/method.Method). The recipes (recipes/<name>.py -> recipe.run), `llmtrain plan`, the
config reference (python -m llmtrain.config) and the run directory (the name an output_dir
records) read it; adding a method is one line here plus its wing's files."""

from __future__ import annotations

from pathlib import Path

from .core.finetune import FINETUNE
from .core.method import Method
from .distill.method import DISTILL
from .preference.method import DPO, REWARD
from .rl.method import GRPO

METHODS: dict[str, Method] = {m.name: m for m in (FINETUNE, DPO, GRPO, REWARD, DISTILL)}
# The method a config with no method's own section is for (its tree is config.Config).
DEFAULT = FINETUNE.name

# The recipes' offline demos in this checkout, found wherever a command runs (llmtrain plan).
DEMOS = Path(__file__).resolve().parents[1] / "recipes" / "configs"


def demo_config(method: Method, folder: Path = DEMOS) -> Path | None:
    """The method's demo YAML, which its recipe runs when given no --config and no model or
    data of the user's (cli.run_config): in `folder` (a recipe's own configs/, beside the
    script, wherever llmtrain is installed), else in this checkout's; None for a method
    without one."""
    if not method.demo:
        return None
    return next((f / method.demo for f in (folder, DEMOS) if (f / method.demo).is_file()), folder / method.demo)


def sections() -> dict[str, str]:
    """The section each method's tree adds to Config's (dpo, grpo, reward, distill) -> the recipe
    that reads it (config.load_config names another recipe's section as that recipe's)."""
    return {m.section: m.schema.RECIPE for m in METHODS.values() if m.section}
