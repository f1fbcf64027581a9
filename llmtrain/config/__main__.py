"""python -m llmtrain.config: the configuration reference, a Markdown table of every key of
every method's tree with its default and docstring (docs/config.md holds it). An entry point
above the package: it reads the method table (llmtrain/methods.py) for the trees."""

from ..methods import METHODS
from .schema import field_docs

print("| key | default | meaning |\n| --- | --- | --- |")
for key, default, doc in field_docs([m.schema for m in METHODS.values()], entries=True):
    print(f"| `{key}` | `{default}` | {doc} |")
