"""python -m llmtrain.config: the configuration reference, a Markdown table of every key
with its default and docstring (docs/config.md holds it)."""

from .schema import field_docs

print("| key | default | meaning |\n| --- | --- | --- |")
for key, default, doc in field_docs():
    print(f"| `{key}` | `{default}` | {doc} |")
