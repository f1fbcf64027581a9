"""What a run of the user's own model and data must set beyond those, for each method."""

from llmtrain.config import load_config
from llmtrain.errors import ConfigError
from llmtrain.methods import sections


def own_required(method) -> dict[str, str]:
    """{key: a stand-in value} of the keys a method requires beyond model.name_or_path and
    data.train (distill.teacher): those its checks call required when only the two are set."""
    try:
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl"], method.schema, sections())
    except ConfigError as e:
        return {q.split(":")[0]: "org/other" for q in e.problems if ": required" in q}
    return {}
