"""Runs recipes/finetune.py for each run named in a JSON file ({name: argv}), one after
another in this one process, so the architecture matrix (tests/launch/test_architectures.py)
starts Python and imports torch once rather than once a run. Prints {name: "ok" or what
went wrong} as JSON on its last line."""

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import finetune  # noqa: E402


def main(spec: str) -> None:
    results = {}
    for name, argv in json.loads(Path(spec).read_text()).items():
        try:
            finetune.main(argv)
            results[name] = "ok"
        except SystemExit as e:
            results[name] = f"exit {e.code}"
        except Exception:
            results[name] = traceback.format_exc()[-3000:]
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
